import math

import pytest
import torch

from rltrain.config import Aggregation, resolve_denominator
from rltrain.masked_mean import AGGREGATIONS, aggregate, group_token_totals, masked_mean, step_totals

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


def test_masked_mean_names_its_aggregation_as_the_loss_and_the_config_do():
    # seq-mean-token-mean with a sequence count of 4: (1.5 + 4) / 4 = 1.375
    assert masked_mean(
        VALUES, MASK, aggregation="seq-mean-token-mean", denominator=4
    ).item() == pytest.approx(1.375)
    # each row's sum over the constant 4, then the mean over the 2 rows: (3/4 + 4/4) / 2 = 0.875
    assert masked_mean(VALUES, MASK, aggregation="seq-mean-token-sum-norm", norm=4).item() == pytest.approx(
        0.875
    )
    # token sums over a sequence count of 2: (3 + 4) / 2 = 3.5
    assert masked_mean(VALUES, MASK, aggregation="seq-mean-token-sum", denominator=2).item() == pytest.approx(
        3.5
    )


def test_the_older_axis_spelling_that_changed_meaning_refuses_with_the_new_one():
    # axis=1 with a denominator divided each row by it (0.875 here); a per-sequence denominator is
    # a sequence count now, so that call says how to write the old meaning instead of changing it
    with pytest.raises(ValueError, match=r"aggregation='seq-mean-token-sum-norm', norm=c"):
        masked_mean(VALUES, MASK, axis=1, denominator=4)


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


def test_resolve_denominator_accepts_token_with_an_axis():
    # every aggregation is exact in token mode now (the per-sequence ones divide by a sequence count)
    assert resolve_denominator("token", axis=1) == "token"
    assert resolve_denominator(4, axis=1) == 4.0
    assert math.isclose(resolve_denominator("8", axis=1), 8.0)


# two sequences: a = [1, 2, 3] (3 loss tokens), b = [4] (1 loss token), c all-masked
AGG_VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
AGG_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])


@pytest.mark.parametrize(
    "aggregation, expected",
    [
        ("token-mean", 10.0 / 4),  # (1 + 2 + 3 + 4) / 4 tokens
        ("seq-mean-token-mean", (6.0 / 3 + 4.0 / 1) / 2),  # (mean a = 2, mean b = 4) / 2 sequences = 3
        ("seq-mean-token-sum", (6.0 + 4.0) / 2),  # (sum a + sum b) / 2 sequences = 5
        ("seq-mean-token-sum-norm", (6.0 + 4.0) / 8 / 2),  # sums / norm 8 / 2 sequences = 0.625
    ],
)
def test_aggregate_by_hand(aggregation, expected):
    got = aggregate(AGG_VALUES, AGG_MASK, aggregation, norm=8.0)
    assert got.item() == pytest.approx(expected)


def test_aggregate_divides_per_sequence_modes_by_the_given_sequence_count():
    # the step holds 5 sequences in all: the same sums / 5 instead of / 2
    got = aggregate(AGG_VALUES, AGG_MASK, "seq-mean-token-mean", denominator=torch.tensor(5.0))
    assert got.item() == pytest.approx((2.0 + 4.0) / 5)
    # a rank holding part of sequence a (tokens 1 and 2 of its 3) divides by the whole count 3
    part = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 0, 0]])
    got = aggregate(AGG_VALUES, part, "seq-mean-token-mean", 1.0, sequence_tokens_B=torch.tensor([3, 1, 0]))
    assert got.item() == pytest.approx((1.0 + 2.0) / 3)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_aggregate_all_masked_gives_zero_and_zero_gradient(aggregation):
    values = torch.randn(2, 3, requires_grad=True)
    out = aggregate(values, torch.zeros(2, 3), aggregation)
    out.backward()
    assert out.item() == 0.0 and torch.equal(values.grad, torch.zeros(2, 3))


def test_aggregate_rejects_an_unknown_mode_and_a_bad_norm():
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate(AGG_VALUES, AGG_MASK, "seq-mean")
    with pytest.raises(ValueError, match="norm must be a positive number"):
        aggregate(AGG_VALUES, AGG_MASK, "seq-mean-token-sum-norm", norm=0)


def test_step_totals_count_tokens_and_sequences_per_group():
    masks = [AGG_MASK, torch.tensor([[0, 1, 1]]), torch.tensor([[1, 1, 0]])]
    tools = [torch.ones(3, 3), torch.tensor([[1, 1, 0]]), torch.ones(1, 3)]
    totals = step_totals(masks, [2, 1], tools)
    # group 0: 4 tokens in 2 sequences, plus [0, 1, 0] after the tool mask: 5 tokens, 3 sequences
    assert totals.tokens.tolist() == [5.0, 2.0] and totals.sequences.tolist() == [3.0, 1.0]
    # a rank that counts only the sequences it owns the first token of
    counted = [torch.tensor([1, 0, 0]), torch.tensor([0]), torch.tensor([1])]
    assert step_totals(masks, [2, 1], tools, counted).sequences.tolist() == [1.0, 1.0]
    assert torch.equal(group_token_totals(masks, [2, 1], tools), totals.tokens)
    assert totals.denominator(0, "token-mean", 2).item() == 2.5  # 5 tokens / 2 ranks
    assert totals.denominator(0, "seq-mean-token-sum", 2).item() == 1.5  # 3 sequences / 2 ranks


def test_the_config_offers_exactly_the_loss_librarys_aggregations():
    # the config imports no other part of rltrain, so it spells the aggregations' names itself
    from typing import get_args

    assert get_args(Aggregation) == AGGREGATIONS
