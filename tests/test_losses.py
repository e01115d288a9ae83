import math

import pytest
import torch

from rltrain.losses import (
    LOG_RATIO_BOUND,
    PolicyLossSettings,
    cispo_loss,
    gspo_loss,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
    ratio,
    sampling_mismatch,
    sft_cross_entropy,
    truncated_is_weights,
)

LN = math.log


def test_ppo_clip_loss_hand_computed():
    # ratios 1.5, 0.5, 1.1, 0.7 with advantages +1, +1, -1, -1; clip_low 0.2, clip_high 0.28
    old = torch.zeros(1, 4)
    logp = torch.tensor([[LN(1.5), LN(0.5), LN(1.1), LN(0.7)]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    loss, clipped = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    # t0: max(-1.5, -clip(1.5)=-1.28) = -1.28 (clipped)
    # t1: max(-0.5, -clip(0.5)=-0.8)  = -0.5  (not clipped: pessimistic branch is the ratio)
    # t2: max(1.1, clip(1.1)=1.1)     = 1.1
    # t3: max(0.7, clip(0.7)=0.8)     = 0.8   (clipped)
    assert loss[0].tolist() == pytest.approx([-1.28, -0.5, 1.1, 0.8])
    assert clipped.tolist() == [[True, False, False, True]]


def test_ppo_dual_clip_caps_negative_advantage_tokens():
    # ratio 5 with A = -1: plain PPO loss = max(5, clip(5)=1.2) = 5; dual clip 3 caps it at 3
    logp = torch.tensor([[LN(5.0), LN(5.0)]])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, clipped = ppo_clip_loss(logp, torch.zeros(1, 2), adv, 0.2, 0.2, dual_clip=3.0)
    # the positive-advantage token is untouched: max(-5, -1.2) = -1.2
    assert loss[0].tolist() == pytest.approx([3.0, -1.2])
    assert clipped.tolist() == [[True, True]]
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, torch.zeros(1, 2), adv, dual_clip=1.0)


def test_cispo_weights_are_clipped_but_gradient_flows():
    logp = torch.tensor([[LN(2.0), LN(0.5)]], requires_grad=True)
    adv = torch.tensor([[1.0, 2.0]])
    loss, clipped = cispo_loss(logp, torch.zeros(1, 2), adv, clip_low=1.0, clip_high=0.2)
    # t0: weight clip(2, 0, 1.2) = 1.2 -> loss = -1.2 * 1 * ln 2; t1: weight 0.5 -> -0.5 * 2 * ln 0.5
    assert loss[0].tolist() == pytest.approx([-1.2 * LN(2.0), -1.0 * LN(0.5)])
    assert clipped.tolist() == [[True, False]]
    loss.sum().backward()
    # d/dlogp = -weight * A: -1.2 and -1.0 (the clipped token still learns, unlike PPO)
    assert logp.grad[0].tolist() == pytest.approx([-1.2, -1.0])


def test_gspo_uses_the_sequence_ratio():
    # sequence 0: log-ratios ln 2 and ln 0.5 on its two loss tokens (third masked): s = exp(0) = 1
    logp = torch.tensor([[LN(2.0), LN(0.5), 9.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]])
    adv = torch.ones(1, 3)
    loss, clipped = gspo_loss(logp, torch.zeros(1, 3), adv, mask, clip_low=0.1, clip_high=0.1)
    # every token carries -A * s = -1 as its value (no clipping at s = 1)
    assert loss[:, :2][0].tolist() == pytest.approx([-1.0, -1.0])
    assert not clipped[:, :2].any()
    (loss * mask).sum().backward()
    # GSPO-token gradient: d(-s * exp(logp - sg(logp)))/dlogp = -s = -1 per loss token
    assert logp.grad[0].tolist() == pytest.approx([-1.0, -1.0, 0.0])


def test_truncated_is_weights():
    learner = torch.tensor([LN(0.5), LN(0.9)])
    generator = torch.tensor([LN(0.1), LN(0.9)])
    # exp(ln .5 - ln .1) = 5 -> capped at 2; exp(0) = 1
    assert truncated_is_weights(learner, generator, cap=2.0).tolist() == pytest.approx([2.0, 1.0])


def test_kl_estimators():
    logp = torch.tensor([LN(0.5)])
    ref = torch.tensor([LN(0.25)])
    d = LN(0.25) - LN(0.5)  # = -ln 2
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(LN(2.0))
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    # k3 = exp(d) - d - 1 = 0.5 + ln 2 - 1
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + LN(2.0) - 1.0)
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_penalty(logp, ref, "k4")


def test_policy_loss_token_denominator_kl_and_tool_mask():
    # two sequences, ratio 1 everywhere so PPO's per-token loss is -A
    logp = torch.zeros(2, 3)
    ref = torch.full((2, 3), -LN(2.0))  # d = ref - logp = -ln 2 -> k1 = ln 2 per token
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    tool = torch.tensor([[1, 0, 1], [1, 1, 1]])  # one tool token in sequence 0
    settings = PolicyLossSettings(kind="ppo", kl_beta=0.1, kl_estimator="k1")
    loss, m = policy_loss(logp, logp, adv, mask, 8.0, settings, tool_mask_BT=tool, ref_logprobs_BT=ref)
    # loss tokens: seq0 t0, t2 (A=1 -> -1 each) and seq1 t0, t1 (A=-2 -> +2 each): pg sum = -2 + 4 = 2
    # kl sum = 4 * ln 2; loss = (2 + 0.1 * 4 ln 2) / 8
    assert loss.item() == pytest.approx((2 + 0.4 * LN(2.0)) / 8)
    assert m["tokens"].item() == 4
    assert m["pg_loss"].item() == pytest.approx(2.0)
    assert m["kl"].item() == pytest.approx(4 * LN(2.0))
    assert m["ratio"].item() == pytest.approx(4.0)


def test_policy_loss_truncated_is_reweights_tokens():
    logp = torch.zeros(1, 2)
    gen = torch.tensor([[LN(0.25), 0.0]])  # weights: min(exp(0 - ln .25) = 4, 2) = 2, and 1
    settings = PolicyLossSettings(tis_cap=2.0)
    loss, _ = policy_loss(
        logp, logp, torch.tensor([1.0]), torch.ones(1, 2), None, settings, generator_logprobs_BT=gen
    )
    # per-token -A * w = -2, -1; mean over 2 tokens = -1.5
    assert loss.item() == pytest.approx(-1.5)


def test_sampling_mismatch_hand_computed_over_loss_tokens_only():
    learner = torch.tensor([[LN(2.0), 0.0, 5.0]])
    generator = torch.tensor([[0.0, LN(0.5), 0.0]])
    keep = torch.tensor([[True, True, False]])  # the third token (d = 5) is not a loss token
    m = sampling_mismatch(learner, generator, keep)
    # d = learner - generator = ln 2, ln 2 (and 5, masked); k3 = e^d - d - 1 = 2 - ln 2 - 1 each
    assert m["mismatch_kl"].item() == pytest.approx(2 * (1 - LN(2.0)))
    assert m["mismatch_max"].item() == pytest.approx(LN(2.0))
    # the same weights on both sides: nothing to report
    same = sampling_mismatch(learner, learner, torch.ones(1, 3, dtype=torch.bool))
    assert same["mismatch_kl"].item() == 0.0 and same["mismatch_max"].item() == 0.0


def test_policy_loss_reports_mismatch_against_the_generator():
    logp, gen = torch.zeros(1, 2), torch.tensor([[LN(0.5), 0.0]])
    _, m = policy_loss(logp, logp, torch.ones(1), torch.ones(1, 2), None, generator_logprobs_BT=gen)
    # d = 0 - ln 0.5 = ln 2 on the first token, 0 on the second: k3 = 2 - ln 2 - 1
    assert m["mismatch_kl"].item() == pytest.approx(1 - LN(2.0))


def test_policy_loss_needs_reference_for_kl():
    with pytest.raises(ValueError, match="reference"):
        policy_loss(
            torch.zeros(1, 2),
            torch.zeros(1, 2),
            torch.ones(1),
            torch.ones(1, 2),
            None,
            PolicyLossSettings(kl_beta=0.1),
        )


def test_sft_cross_entropy_with_token_denominator():
    # vocab 2, uniform logits: every token's NLL is ln 2
    logits = torch.zeros(1, 3, 2)
    labels = torch.tensor([[0, 1, 1]])
    mask = torch.tensor([[1, 1, 0]])
    # two supervised tokens: default mean = ln 2; with a group total of 8: 2 ln 2 / 8
    assert sft_cross_entropy(logits, labels, mask).item() == pytest.approx(LN(2.0))
    assert sft_cross_entropy(logits, labels, mask, torch.tensor(8.0)).item() == pytest.approx(LN(2.0) / 4)


def test_a_huge_log_ratio_gives_a_finite_loss_and_gradient():
    # a broken sync: the learner's log-prob is 200 nats above the generator's; exp(200) is inf in fp32
    logprobs = torch.tensor([[-0.1, -1.0]], requires_grad=True)
    old = torch.tensor([[-200.1, -1.0]])
    for kind in ("ppo", "cispo", "gspo"):
        settings = PolicyLossSettings(kind=kind, clip_low=10.0, clip_high=1e9, kl_beta=0.1, tis_cap=None)
        loss, metrics = policy_loss(logprobs, old, torch.tensor([1.0]), torch.ones(1, 2), None, settings,
                                    ref_logprobs_BT=old)  # fmt: skip
        (grad,) = torch.autograd.grad(loss, logprobs)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and torch.isfinite(metrics["ratio"]), kind
    # the ratio saturates at exp(LOG_RATIO_BOUND)
    assert ratio(torch.tensor(0.0), torch.tensor(-1e4)).item() == pytest.approx(math.exp(LOG_RATIO_BOUND))
    assert ratio(torch.tensor(0.0), torch.tensor(1e4)).item() == pytest.approx(math.exp(-LOG_RATIO_BOUND))


def test_kl_abs_and_straight_through_k3_plus():
    logprobs = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    # d = ref - logp = [-0.5, 1.0]; abs: |d| = [0.5, 1.0]
    assert kl_penalty(logprobs, ref, "abs").tolist() == pytest.approx([0.5, 1.0])
    # k3+: the value of k3 = exp(d) - d - 1 = [e^-0.5 - 0.5, e - 2] ...
    k3_plus = kl_penalty(logprobs, ref, "k3+")
    assert k3_plus.tolist() == pytest.approx([math.exp(-0.5) - 0.5, math.e - 2])
    # ... and the gradient of k2 = d^2 / 2: d(k2)/d(logp) = -d = [0.5, -1.0]
    (grad,) = torch.autograd.grad(k3_plus.sum(), logprobs)
    assert grad.tolist() == pytest.approx([0.5, -1.0])
    with pytest.raises(ValueError, match="k3\\+, abs"):
        kl_penalty(logprobs, ref, "k4")


def test_gspo_sequence_ratio_uses_the_whole_sequence_when_a_rank_holds_part():
    # a sequence of 4 tokens with log-ratios [0.4, 0.0, 0.2, 0.2] (mean 0.2); this rank holds the
    # first two (sum 0.4); the other rank's part (sum 0.4) arrives through sequence_sum
    old = torch.zeros(1, 4)
    logprobs = torch.tensor([[0.4, 0.0, 0.2, 0.2]])
    held = torch.tensor([[1, 1, 0, 0]])
    loss, _ = gspo_loss(logprobs, old, -torch.ones(1, 4), held, 10.0, 10.0,
                        sequence_tokens_B=torch.tensor([4]), sequence_sum=lambda x: x + 0.4)  # fmt: skip
    # every token's ratio is exp(0.8 / 4) = exp(0.2); loss = -A * ratio = exp(0.2)
    assert loss[0, :2].tolist() == pytest.approx([math.exp(0.2)] * 2)


def test_dppo_masks_tokens_moved_past_the_divergence_bound_in_their_advantages_direction():
    from rltrain.loss.dppo import dppo_loss

    # anchor probability 0.5 everywhere; the policy's 0.7, 0.55, 0.3, 0.45, 0.3
    anchor = torch.full((1, 5), 0.5).log()
    logprobs = torch.tensor([[0.7, 0.55, 0.3, 0.45, 0.3]]).log().requires_grad_()
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    # TV, delta 0.1: token 0 moved up 0.2 with A > 0 (masked high), token 2 down 0.2 with A < 0
    # (masked low); tokens 1 and 3 moved 0.05; token 4 moved down 0.2 but A > 0: not its direction
    loss, low, high = dppo_loss(logprobs, anchor, advantages, "tv", 0.1, 0.1)
    assert low.tolist() == [[False, False, True, False, False]]
    assert high.tolist() == [[True, False, False, False, False]]
    # -A * r on the rest: token 1 -1.1 (0.55 / 0.5), token 3 +0.9, token 4 -0.6
    torch.testing.assert_close(loss, torch.tensor([[0.0, -1.1, 0.0, 0.9, -0.6]]))
    loss.sum().backward()  # d(-A r)/d log p = -A r
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -1.1, 0.0, 0.9, -0.6]]))
    # a ratio cap of 1.05: token 1's r = 1.1 counts 1.05, in value and in its gradient's weight
    logprobs.grad = None
    capped, _, _ = dppo_loss(logprobs, anchor, advantages, "tv", 0.1, 0.1, ratio_cap=1.05)
    capped.sum().backward()
    assert capped[0, 1].item() == pytest.approx(-1.05) and logprobs.grad[0, 1].item() == pytest.approx(-1.05)
    # KL(Bern(0.5) || Bern(0.7)) = 0.5 ln(0.5/0.7) + 0.5 ln(0.5/0.3) = 0.0872 > 0.05: masked;
    # KL(Bern(0.5) || Bern(0.55)) = 0.5 ln(0.5/0.55) + 0.5 ln(0.5/0.45) = 0.0050: kept
    _, low, high = dppo_loss(logprobs, anchor, advantages, "kl", 0.05, 0.05)
    assert high.tolist() == [[True, False, False, False, False]]
    assert low.tolist() == [[False, False, True, False, False]]  # (0.5 -> 0.3: 0.0872 as well)
