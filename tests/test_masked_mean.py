import math

import pytest
import torch

from rltrain.masked_mean import group_token_totals, masked_mean, resolve_denominator

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_masked_mean_all_tokens():
    # (1 + 2 + 4) / 3 tokens = 7/3
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7 / 3)


def test_masked_mean_constant_denominator():
    # (1 + 2 + 4) / 10 = 0.7
    assert masked_mean(VALUES, MASK, denominator=10).item() == pytest.approx(0.7)


def test_masked_mean_tensor_denominator():
    # (1 + 2 + 4) / 14 = 0.5
    assert masked_mean(VALUES, MASK, denominator=torch.tensor(14.0)).item() == pytest.approx(0.5)


def test_masked_mean_per_sequence():
    # row 0: (1 + 2) / 2 = 1.5; row 1: 4 / 1 = 4; mean of rows = 2.75
    assert masked_mean(VALUES, MASK, axis=1).item() == pytest.approx(2.75)


def test_masked_mean_per_sequence_skips_empty_rows():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    # row 0: 1.5; row 1 has no tokens and is not counted: mean = 1.5 (not 0.75)
    assert masked_mean(VALUES, mask, axis=1).item() == pytest.approx(1.5)


def test_masked_mean_per_sequence_constant_denominator():
    # row 0: (1 + 2) / 4 = 0.75; row 1: 4 / 4 = 1; mean = 0.875
    assert masked_mean(VALUES, MASK, axis=1, denominator=4).item() == pytest.approx(0.875)


@pytest.mark.parametrize("axis", [None, 1])
def test_all_zero_mask_gives_zero_value_and_zero_gradient(axis):
    values = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]], requires_grad=True)
    out = masked_mean(values, torch.zeros(2, 2), axis=axis)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(values.grad, torch.zeros(2, 2))


def test_masked_positions_holding_nan_do_not_leak():
    values = torch.tensor([1.0, float("nan"), 3.0], requires_grad=True)
    out = masked_mean(values, torch.tensor([1, 0, 1]))
    out.backward()
    # (1 + 3) / 2 = 2; gradient 1/2 on kept positions, 0 on the masked NaN
    assert out.item() == 2.0
    assert values.grad.tolist() == [0.5, 0.0, 0.5]


@pytest.mark.parametrize("bad", [0, -1, float("nan")])
def test_masked_mean_rejects_non_positive_constant(bad):
    with pytest.raises(ValueError, match="positive"):
        masked_mean(VALUES, MASK, denominator=bad)


def test_group_token_totals_single_process_with_tool_masks_and_short_last_group():
    masks = [torch.ones(2, 3), torch.tensor([[1, 1, 0]]), torch.zeros(1, 4), torch.ones(1, 2)]
    tools = [torch.tensor([[1, 0, 1], [1, 1, 1]]), torch.ones(1, 3), torch.ones(1, 4), torch.tensor([[0, 1]])]
    totals = group_token_totals(masks, accumulation_steps=3, tool_masks=tools)
    # group 0 = micro-batches 0..2: (6 - 1 tool token) + 2 + 0 = 7
    # group 1 = micro-batch 3 alone: 2 - 1 tool token = 1
    assert totals.dtype == torch.float32
    assert totals.tolist() == [7.0, 1.0]


def test_group_token_totals_rejects_mismatched_tool_masks():
    with pytest.raises(ValueError, match="does not match"):
        group_token_totals([torch.ones(2, 3)], 1, tool_masks=[torch.ones(2, 2)])
    with pytest.raises(ValueError, match="tool_masks"):
        group_token_totals([torch.ones(2, 3)], 1, tool_masks=[])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("token", "token"),
        (1, 1.0),
        (2048, 2048.0),
        (0.5, 0.5),
        ("1024", 1024.0),
        ("1e3", 1000.0),
    ],
)
def test_resolve_denominator_accepts(value, expected):
    assert resolve_denominator(value) == expected


@pytest.mark.parametrize("value", ["tokens", 0, -1, "abc", "0", "-3", True, float("inf"), "nan", [1]])
def test_resolve_denominator_rejects_with_key_value_and_accepted_forms(value):
    with pytest.raises(ValueError) as info:
        resolve_denominator(value)
    message = str(info.value)
    assert message.startswith("masked_mean_denominator:")
    assert repr(value) in message
    assert '"token"' in message and "positive number" in message


def test_resolve_denominator_rejects_token_with_axis():
    with pytest.raises(ValueError, match=r"masked_mean_denominator: got \"token\" with masked_mean_axis=1"):
        resolve_denominator("token", axis=1)
    # a constant with an axis is fine (Dr. GRPO per-sequence sums / constant)
    assert resolve_denominator(4, axis=1) == 4.0
    assert math.isclose(resolve_denominator("8", axis=1), 8.0)
