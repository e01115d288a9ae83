"""Rollout corrections by hand (rltrain.loss.corrections): truncated weights, masked importance sampling,
the geometric sequence mask, per token and per sequence, and a sequence split over ranks."""

import math

import pytest
import torch

from rltrain.loss.corrections import RolloutCorrection, correction_mask, correction_weights
from rltrain.losses import PolicyLossSettings, policy_loss

LN = math.log
ALL = torch.ones(2, 2, dtype=torch.bool)


def test_truncated_weights_per_token_and_per_sequence():
    learner = torch.tensor([[LN(4.0), LN(0.5)], [LN(2.0), LN(2.0)]])
    generator = torch.zeros(2, 2)
    token = correction_weights(learner, generator, ALL, RolloutCorrection("tis", cap=2.0))
    assert token.flatten().tolist() == pytest.approx([2.0, 0.5, 2.0, 2.0])  # min(r, 2): 4 -> 2, .5, 2, 2
    seq = correction_weights(learner, generator, ALL, RolloutCorrection("tis", "sequence", cap=3.0))
    # sequence ratios 4 * 0.5 = 2 and 2 * 2 = 4 -> min(., 3): 2 and 3 for every token of the row
    assert seq.flatten().tolist() == pytest.approx([2.0, 2.0, 3.0, 3.0])
    assert correction_mask(learner, generator, ALL, RolloutCorrection("tis")).all()  # tis rejects nothing


def test_masked_importance_sampling_rejects_tokens_or_whole_sequences_outside_the_bounds():
    learner = torch.tensor([[LN(4.0), 0.0], [LN(0.25), LN(0.5)]])
    generator = torch.zeros(2, 2)
    mis = RolloutCorrection("mis", low=0.5, high=2.0)
    # ratios 4, 1, 0.25, 0.5: outside, inside, outside, on the bound (inside)
    assert correction_mask(learner, generator, ALL, mis).tolist() == [[False, True], [False, True]]
    seq = RolloutCorrection("mis", "sequence", low=0.5, high=8.0)
    # sequence ratios 4 * 1 = 4 (kept) and 0.25 * 0.5 = 0.125 (rejected, whole)
    assert correction_mask(learner, generator, ALL, seq).tolist() == [[True, True], [False, False]]
    assert (correction_weights(learner, generator, ALL, mis) == 1).all()


def test_geometric_sequence_mask_uses_the_mean_log_ratio_over_loss_tokens():
    learner = torch.tensor([[LN(4.0), 0.0, 9.0], [LN(4.0), LN(4.0), 0.0]])
    generator = torch.zeros(2, 3)
    keep = torch.tensor([[True, True, False], [True, True, True]])
    geo = RolloutCorrection("geo_mask", "sequence", low=0.5, high=2.0)
    # row 0: exp((ln 4 + 0) / 2) = 2 (inside; the masked 9.0 is not a loss token);
    # row 1: exp((ln 4 + ln 4 + 0) / 3) = 4^(2/3) = 2.52 (outside: the whole row leaves)
    assert correction_mask(learner, generator, keep, geo).tolist() == [[True, True, False], [False] * 3]
    with pytest.raises(ValueError, match="sequence rule"):
        RolloutCorrection("geo_mask", "token")


def test_a_sequence_split_over_two_ranks_is_judged_whole():
    # one sequence of 4 tokens, log-ratios ln 2 each: its ratio 16 exceeds high=8, each half's (4) does not
    learner, generator = torch.full((1, 4), LN(2.0)), torch.zeros(1, 4)
    seq = RolloutCorrection("mis", "sequence", low=0.5, high=8.0)
    halves = [torch.tensor([[True, True, False, False]]), torch.tensor([[False, False, True, True]])]
    assert correction_mask(learner, generator, halves[0], seq).any()  # alone, a rank would keep its half

    def other_half_added(values):  # the all-reduce of a 2-rank group: this half's value plus the other's
        return values * 2

    for half in halves:
        assert not correction_mask(learner, generator, half, seq, other_half_added).any()


def test_policy_loss_drops_rejected_tokens_and_counts_them():
    logp = torch.zeros(1, 3)
    generator = torch.tensor([[0.0, LN(4.0), 0.0]])  # ratio 1/4 on the second token: rejected
    settings = PolicyLossSettings(correction=RolloutCorrection("mis", low=0.5, high=2.0))
    advantages = torch.tensor([1.0])
    loss, m = policy_loss(
        logp, logp, advantages, torch.ones(1, 3), None, settings, generator_logprobs_BT=generator
    )
    # two loss tokens left, each -A * r = -1: their mean is -1; one token rejected
    assert loss.item() == pytest.approx(-1.0)
    assert m["tokens"].item() == 2 and m["rejected"].item() == 1
    # the mismatch is measured over every sampled token, the rejected one included:
    # d = learner - generator = -ln 4 there, k3 = e^d - d - 1 = 1/4 + ln 4 - 1
    assert m["mismatch_kl"].item() == pytest.approx(0.25 + LN(4.0) - 1)
