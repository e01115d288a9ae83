"""GAE over masked tokens, whitening and the clipped value loss: hand-computed cases."""

import pytest
import torch

from rltrain.loss.advantages import gae_advantages, whiten
from rltrain.losses import value_loss
from rltrain.masked_mean import masked_mean


def test_gae_matches_the_recursion_by_hand():
    # one row, three policy tokens, reward 1 on the last; gamma 0.5, lam 0.5
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.6]])
    mask = torch.ones(1, 3)
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.5, lam=0.5)
    # delta_2 = 1 + 0.5 * 0 - 0.6 = 0.4                  A_2 = 0.4
    # delta_1 = 0 + 0.5 * 0.6 - 0.4 = -0.1               A_1 = -0.1 + 0.25 * 0.4 = 0.0
    # delta_0 = 0 + 0.5 * 0.4 - 0.2 = 0.0                A_0 = 0.0 + 0.25 * 0.0 = 0.0
    assert advantages.tolist()[0] == pytest.approx([0.0, 0.0, 0.4])
    # R = A + V
    assert returns.tolist()[0] == pytest.approx([0.2, 0.4, 1.0])


def test_torchtune_estimate_returns_case():
    # torchtune's test_estimate_returns: values = rewards = [0, 0, 0, 1], gamma 0.9, lambda 0.95
    values = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    gamma, lam = 0.9, 0.95
    _, returns = gae_advantages(rewards, values, torch.ones(1, 4), gamma, lam)
    # t3: delta 1 - 1 = 0, A 0, R 1;  t2: delta 0.9 * 1 - 0 = 0.9, A 0.9, R = gamma
    # t1: delta 0, A = gamma * lam * 0.9 = gamma^2 lam;  t0: A = gamma * lam * A1 = gamma^3 lam^2
    expected = [gamma**3 * lam**2, gamma**2 * lam, gamma, 1.0]
    assert returns.tolist()[0] == pytest.approx(expected)


def test_gamma_one_lam_one_gives_reward_to_go_minus_value():
    # Monte Carlo: A_t = sum of later rewards - V_t; rewards 1, 0, 2 -> to-go 3, 2, 2
    rewards = torch.tensor([[1.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 1.0, 1.5]])
    advantages, returns = gae_advantages(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert advantages.tolist()[0] == pytest.approx([2.5, 1.0, 0.5])
    assert returns.tolist()[0] == pytest.approx([3.0, 2.0, 2.0])


def test_masked_positions_are_not_steps():
    # prompt (col 0), policy tokens (cols 1, 2), tool output (cols 3, 4), policy tokens (5, 6), padding (7)
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.0, 0.1, 0.2, 0.0, 0.0, 0.3, 0.4, 0.0]])
    advantages, returns = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # the same episode with the masked positions removed
    compact_adv, compact_ret = gae_advantages(
        torch.tensor([[0.0, 0.0, 0.0, 1.0]]), torch.tensor([[0.1, 0.2, 0.3, 0.4]]), torch.ones(1, 4), 0.9, 0.8
    )
    keep = mask.bool()
    torch.testing.assert_close(advantages[keep], compact_adv[0])
    torch.testing.assert_close(returns[keep], compact_ret[0])
    assert (advantages[~keep] == 0).all() and (returns[~keep] == 0).all()
    # whatever rewards or values hold off the mask cannot change anything (verl's multi-turn check)
    noisy_values = torch.where(keep, values, torch.randn(1, 8) * 100)
    noisy_rewards = torch.where(keep, rewards, torch.randn(1, 8) * 100)
    again, again_returns = gae_advantages(noisy_rewards, noisy_values, mask, gamma=0.9, lam=0.8)
    assert torch.equal(again, advantages) and torch.equal(again_returns, returns)


def test_whiten_uses_one_mean_and_std_over_all_masked_tokens():
    values = torch.tensor([[1.0, 3.0, 99.0], [5.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # tokens 1, 3, 5: mean 3, unbiased std 2 -> -1, 0, 1; masked positions 0
    assert whiten(values, mask, eps=0.0).tolist() == [[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]


def test_value_loss_clipping_by_hand():
    old = torch.tensor([[0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.1, -0.5]])
    returns = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1]])
    loss, metrics = value_loss(values, old, returns, mask, denominator=None, value_clip=0.2)
    # token 0: unclipped (0.5-1)^2 = 0.25, clipped v=0.2 -> (0.2-1)^2 = 0.64 -> max 0.64 (clipped taken)
    # token 1: v=0.1 inside the clip range: both 0.81 -> 0.81
    # token 2: unclipped (-0.5-1)^2 = 2.25, clipped v=-0.2 -> 1.44 -> max 2.25
    # loss = 0.5 * (0.64 + 0.81 + 2.25) / 3
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 2.25) / 3)
    assert metrics["value_clipped"].item() == 1.0
    assert metrics["tokens"].item() == 3.0


def test_value_loss_takes_the_step_token_total_as_denominator():
    values = torch.tensor([[1.0, 2.0], [3.0, 0.0]], requires_grad=True)
    returns = torch.zeros(2, 2)
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, _ = value_loss(
        values, values.detach(), returns, mask, denominator=torch.tensor(6.0), value_clip=None
    )
    # 0.5 * (1 + 4 + 9) / 6 (the masked token is left out)
    assert loss.item() == pytest.approx(0.5 * 14 / 6)
    expected = masked_mean(0.5 * values**2, mask, denominator=6.0)
    assert loss.item() == pytest.approx(expected.item())


def test_with_gae_puts_the_reward_on_the_last_policy_token_and_whitens_globally():
    from rltrain.batch import TrainBatch
    from rltrain.config import AlgorithmConfig
    from rltrain.run.scoring import with_gae

    # row 0: prompt, 2 policy tokens, a tool token, 1 policy token, padding; row 1: all masked
    response = torch.tensor([[0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
    tool = torch.tensor([[1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]])
    batch = TrainBatch(
        input_ids=torch.zeros(2, 6, dtype=torch.long),
        attention_mask=torch.ones(2, 6, dtype=torch.long),
        response_mask=response,
        tool_mask=tool,
        advantages=torch.zeros(2),
        generator_logprobs=torch.full((2, 6), -1.0),
    )
    values = torch.zeros(2, 6)
    alg = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0)
    out = with_gae(batch, torch.tensor([2.0, 5.0]), values, alg)
    # values 0, gamma = lam = 1: every policy token's return is the reward to go, 2
    assert out.returns.tolist() == [[0, 2, 2, 0, 2, 0], [0] * 6]
    # advantages 2, 2, 2 whitened over the batch's three loss tokens: std 0 -> all 0
    assert out.advantages.abs().max().item() == pytest.approx(0.0)
    assert torch.equal(out.old_values, values)
    # a per-token KL penalty in the reward: 0.5 * (log pi_gen - log pi_ref) = 0.5 * (-1 - (-2)) = 0.5
    shaped = with_gae(
        batch, torch.tensor([2.0, 5.0]), values, AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, kl_in_reward=0.5),
        ref_logprobs_BT=torch.full((2, 6), -2.0),
    )  # fmt: skip
    # rewards -0.5, -0.5, (tool), 2 - 0.5: returns to go 0.5, 1.0, 1.5
    assert shaped.returns[0, [1, 2, 4]].tolist() == pytest.approx([0.5, 1.0, 1.5])


def test_question_sums_take_each_samples_first_sampled_token_once():
    from rltrain.loss.losses import question_sums

    keep = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])  # row 1: nothing sampled
    returns = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]])
    residual = torch.tensor([[9.0, 0.25, 7.0, 0.0], [3.0, 3.0, 3.0, 3.0], [-0.5, 8.0, 0.0, 0.0]])
    # rows 0 and 2 at their first sampled token (columns 1 and 0): R = 1.0, 0.5; R - V = 0.25, -0.5
    # -> [2, 1.5, 1 + 0.25, 0.25 - 0.5, 0.0625 + 0.25]
    sums = question_sums(keep, returns, residual, None)
    assert sums.tolist() == pytest.approx([2, 1.5, 1.25, -0.25, 0.3125])
    # a sequence-parallel rank that does not hold row 0's first token counts row 2 alone
    sums = question_sums(keep, returns, residual, torch.tensor([0, 1, 1]))
    assert sums.tolist() == pytest.approx([1, 0.5, 0.25, -0.5, 0.25])
