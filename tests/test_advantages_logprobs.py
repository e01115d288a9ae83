import math

import pytest
import torch

from rltrain.loss.advantages import grpo_advantages, rloo_advantages, zero_variance_groups
from rltrain.loss.logprobs import token_entropy, token_logprobs


def test_grpo_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo_advantages(rewards, group_size=4, eps=0.0)
    # group 0: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 1/sqrt(3) -> +-0.5 * sqrt(3)
    s = 0.5 * math.sqrt(3)
    # group 1: zero variance -> 0 / (0 + eps) = 0 (eps 0 would give nan, so use the default below)
    assert adv[:4].tolist() == pytest.approx([s, -s, s, -s])
    assert grpo_advantages(rewards, 4)[4:].tolist() == [0.0] * 4


def test_dr_grpo_skips_std():
    rewards = torch.tensor([3.0, 1.0])
    # mean 2 -> +1, -1 regardless of the spread
    assert grpo_advantages(rewards, 2, normalize_std=False).tolist() == [1.0, -1.0]


def test_rloo_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0])
    # r0 - mean(0, 0) = 1; r1 - mean(1, 0) = -0.5; r2 likewise -0.5
    assert rloo_advantages(rewards, 3).tolist() == pytest.approx([1.0, -0.5, -0.5])
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(rewards, 1)


def test_zero_variance_groups_and_bad_group_size():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    assert zero_variance_groups(rewards, 2).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="do not split"):
        grpo_advantages(rewards, 4)


def test_token_logprobs_hand_computed_with_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # softmax = [1/4, 3/4]
    assert token_logprobs(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))
    # temperature 0.5 doubles the logits: softmax = [1/10, 9/10]
    assert token_logprobs(logits, torch.tensor([[1]]), temperature=0.5).item() == pytest.approx(math.log(0.9))
    # entropy of [1/4, 3/4] = -(.25 ln .25 + .75 ln .75)
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert token_entropy(logits).item() == pytest.approx(expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_full_log_softmax_values_and_gradients(dtype, temperature):
    torch.manual_seed(0)
    logits = (3 * torch.randn(3, 5, 50)).to(dtype).requires_grad_(True)
    ids = torch.randint(0, 50, (3, 5))
    weights = torch.randn(3, 5)
    # a chunk budget of 2 rows (2 * 50 floats * 4 bytes) forces 8 chunks over 15 rows
    ours = token_logprobs(logits, ids, temperature, max_chunk_bytes=400)
    (ours * weights).sum().backward()
    grad_ours, logits.grad = logits.grad.clone(), None

    full = torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[..., None]).squeeze(-1)
    (full * weights).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours, full, atol=tol, rtol=tol)
    torch.testing.assert_close(grad_ours.float(), logits.grad.float(), atol=tol, rtol=tol)
    log_p = torch.log_softmax(logits.detach().float() / temperature, -1)
    entropy_full = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(
        token_entropy(logits, temperature, max_chunk_bytes=400), entropy_full, atol=1e-4, rtol=1e-4
    )


def test_logprobs_leave_float32_logits_untouched():
    # the chunked kernel works in place on its float32 copy; the caller's logits must not change
    logits = torch.randn(2, 3, 7, requires_grad=True)
    before = logits.detach().clone()
    token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), temperature=0.5).sum().backward()
    assert torch.equal(logits.detach(), before)


@pytest.mark.parametrize("value", [0.7, 0.1, 1.1, 1.0 + 0.1, -0.3, 1e6 + 0.1])
@pytest.mark.parametrize("group_size", range(2, 17))
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(value, group_size):
    # float32 rounding of the mean of eight 0.7s is ~6e-8; divided by std + 1e-6 it used to give +0.056
    for dtype in (torch.float32, torch.float64):
        rewards = torch.cat(
            [torch.full((group_size,), value, dtype=dtype), torch.arange(group_size, dtype=dtype)]
        )
        for advantages in (grpo_advantages(rewards, group_size), grpo_advantages(rewards, group_size, False),
                           rloo_advantages(rewards, group_size)):  # fmt: skip
            assert torch.equal(advantages[:group_size], torch.zeros(group_size, dtype=dtype))
            assert advantages[group_size:].abs().sum() > 0  # the informative group keeps its advantages
            assert advantages.dtype == dtype  # float64 passes through, no silent downcast


def test_group_statistics_are_computed_in_float64():
    # rewards 0 and 1e-7 on top of 1e4: float32 cannot hold 1e4 + 1e-7, float64 can
    rewards = torch.tensor([1e4, 1e4 + 1e-7], dtype=torch.float64)
    assert grpo_advantages(rewards, 2, normalize_std=False).tolist() == pytest.approx([-5e-8, 5e-8], rel=1e-3)


def test_nucleus_truncation_gives_the_renormalized_log_probs_the_engine_reports():
    # probabilities 0.5, 0.3, 0.15, 0.05, top_p 0.8: ascending, the running sums are 0.05, 0.2, 0.5, 1;
    # those at most 1 - 0.8 = 0.2 go (0.05 and 0.15), so 0.5 and 0.3 stay and sum to 0.8
    from rltrain.loss.logprobs import Truncation

    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()[None]  # [1, 1, 4]
    nucleus = Truncation(top_p=0.8)
    for token, expected in [(0, math.log(0.5 / 0.8)), (1, math.log(0.3 / 0.8))]:
        got = token_logprobs(logits, torch.tensor([[token]]), truncation=nucleus).item()
        assert got == pytest.approx(expected, abs=1e-6)
        # the whole distribution's log-prob is off by log(0.8) = -0.223: the bias of a ratio of the two
        assert token_logprobs(logits, torch.tensor([[token]])).item() - got == pytest.approx(
            math.log(0.8), abs=1e-6
        )
    # top_k=1 keeps 0.5 alone (log-prob 0); min_p=0.5 keeps p >= 0.25: 0.5 and 0.3, as top_p=0.8 did
    assert token_logprobs(
        logits, torch.tensor([[0]]), truncation=Truncation(top_k=1)
    ).item() == pytest.approx(0.0, abs=1e-6)
    got = token_logprobs(logits, torch.tensor([[1]]), truncation=Truncation(min_p=0.5)).item()
    assert got == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)


@pytest.mark.parametrize(
    "settings", [{"top_p": 0.9}, {"top_k": 7}, {"top_k": 20, "top_p": 0.7}, {"min_p": 0.1, "top_p": 0.95}]
)
def test_truncated_log_probs_keep_the_sampled_token_and_match_a_masked_log_softmax_with_gradients(settings):
    from rltrain.loss.logprobs import Truncation, token_logprobs_and_entropy, truncation_keep

    g = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(3, 5, 50, generator=g)).requires_grad_(True)
    targets = torch.randint(0, 50, (3, 5), generator=g)
    truncation, temperature = Truncation(**settings), 0.7
    logprobs, entropy = token_logprobs_and_entropy(
        logits, targets, temperature, truncation=truncation, max_chunk_bytes=800
    )
    # reference: the same kept set through a plain masked log-softmax
    z = logits.detach().reshape(-1, 50) / temperature
    keep = truncation_keep(z, targets.reshape(-1), truncation)
    assert keep.sum(-1).min() >= 1 and keep.gather(-1, targets.reshape(-1, 1)).all()
    ref_logits = logits.clone().detach().requires_grad_(True)
    masked = (ref_logits.reshape(-1, 50) / temperature).masked_fill(~keep, float("-inf")).log_softmax(-1)
    ref = masked.gather(-1, targets.reshape(-1, 1)).reshape(3, 5)
    assert torch.allclose(logprobs, ref, atol=1e-5)
    p = masked.exp()
    assert torch.allclose(entropy, -(p * masked.nan_to_num(neginf=0.0)).sum(-1).reshape(3, 5), atol=1e-5)
    logprobs.sum().backward()
    ref.sum().backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-5)
    assert (keep.sum(-1) < 50).any()  # the settings truncate something here


@pytest.mark.slow
def test_the_kept_set_is_vllms():
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from rltrain.loss.logprobs import Truncation, truncation_keep

    z = 3 * torch.randn(64, 300, generator=torch.Generator().manual_seed(1))
    for k, p in [(10, None), (None, 0.9), (40, 0.8), (300, 0.5)]:
        theirs = apply_top_k_top_p_pytorch(
            z.clone(),
            None if k is None else torch.full((64,), k),
            None if p is None else torch.full((64,), p),
        )
        mine = truncation_keep(z, theirs.argmax(-1), Truncation(top_k=k or 0, top_p=p or 1.0))
        assert torch.equal(mine, theirs > float("-inf")), (k, p)


def test_invalid_samples_leave_their_groups_statistics_and_get_no_advantage():
    from rltrain.loss.advantages import grpo_advantages, rloo_advantages, zero_variance_groups

    # one group of 4, the third sample's reward could not be computed (its 5.0 must count nowhere)
    rewards = torch.tensor([1.0, 0.0, 5.0, 0.0])
    valid = torch.tensor([True, True, False, True])
    # valid rewards 1, 0, 0: mean 1/3; unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std = (1 / 3) ** 0.5
    expected = torch.tensor([(2 / 3) / std, (-1 / 3) / std, 0.0, (-1 / 3) / std])
    torch.testing.assert_close(grpo_advantages(rewards, 4, valid_N=valid), expected, atol=1e-5, rtol=0)
    # Dr. GRPO: r - mean only
    dr = grpo_advantages(rewards, 4, normalize_std=False, valid_N=valid)
    torch.testing.assert_close(dr, torch.tensor([2 / 3, -1 / 3, 0.0, -1 / 3]))
    # RLOO: r_i - (sum of the other valid) / 2: 1 - 0, 0 - 1/2, -, 0 - 1/2
    torch.testing.assert_close(
        rloo_advantages(rewards, 4, valid_N=valid), torch.tensor([1.0, -0.5, 0.0, -0.5])
    )
    # the same group with the failed sample's reward counted would differ (the bug this prevents)
    assert not torch.allclose(grpo_advantages(rewards, 4), expected)
    # a group whose valid samples agree is a zero-variance group, whatever the invalid one holds
    same = torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert (
        zero_variance_groups(same, 4, valid).tolist() == [True] and not zero_variance_groups(same, 4).item()
    )
    assert grpo_advantages(same, 4, valid_N=valid).abs().sum() == 0
