"""DPPO against the peers' own released code (verl 0.9.1's ``compute_policy_loss_dppo_tv``/``_kl``,
SkyRL 0.3.0's ``dppo_policy_loss``), read from their wheels (``scripts/setup_env.sh`` downloads
them to ``.venv/peers``) and run without their trainers: each function's source is taken from its
file and executed beside stand-ins for the trainer plumbing it only passes through (a registry
decorator, the off-policy correction SkyRL applies after the loss, here disabled)."""

import ast
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from rltrain.loss.corrections import RolloutCorrection
from rltrain.loss.dppo import dppo_loss, dppo_mask
from rltrain.loss.losses import PolicyLossSettings, policy_loss

PEERS = Path(sys.prefix) / "peers"


def peer_functions(wheel: str, member: str, names: list[str], namespace: dict) -> dict:
    """``names``'s functions from ``member`` of the wheel, decorators dropped, defined in ``namespace``."""
    found = sorted(PEERS.glob(wheel))
    assert found, f"{wheel} is not in {PEERS} (scripts/setup_env.sh downloads it)"
    with zipfile.ZipFile(found[-1]) as archive:
        tree = ast.parse(archive.read(member).decode())
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(f.name for f in functions) == sorted(names)
    for function in functions:
        function.decorator_list = []
    exec(compile(ast.Module(functions, []), member, "exec"), namespace)  # noqa: S102
    return namespace


def verl() -> dict:
    helpers = peer_functions("verl-*.whl", "verl/utils/torch_functional.py", ["masked_mean", "masked_sum"],
                             {"torch": torch})  # fmt: skip
    # its rollout correction's weights (rollout_is_weights), without the metrics beside them
    corrections = peer_functions(
        "verl-*.whl", "verl/trainer/ppo/rollout_corr_helper.py",
        ["compute_rollout_correction_weights", "_parse_rollout_is_threshold"],
        {"torch": torch, "Optional": Optional, "SAFETY_BOUND": 20.0, "verl_F": SimpleNamespace(**helpers),
         "compute_is_metrics": lambda **kwargs: {}},
    )  # fmt: skip
    return corrections | peer_functions(
        "verl-*.whl", "verl/trainer/ppo/core_algos.py",
        ["agg_loss", "compute_policy_loss_dppo_tv", "compute_policy_loss_dppo_kl"],
        {"torch": torch, "Optional": Optional, "Any": Any, "ActorConfig": Any, "AlgoConfig": type("AlgoConfig", (), {}),
         "verl_F": SimpleNamespace(**helpers)},
    )  # fmt: skip


def skyrl() -> dict:
    helpers = peer_functions("skyrl-*.whl", "skyrl/backends/skyrl_train/utils/torch_utils.py",
                             ["masked_mean", "safe_exp_delta"], {"torch": torch})  # fmt: skip
    return peer_functions(
        "skyrl-*.whl", "skyrl/backends/skyrl_train/utils/ppo_utils.py", ["dppo_policy_loss", "reduce_loss"],
        {"torch": torch, "Optional": Optional, "Tuple": tuple, "AlgorithmConfig": Any, **helpers,
         # (off-policy correction disabled: the loss and its mask go on unchanged)
         "apply_off_policy_correction": lambda loss, old, rollout, mask, config: (loss, mask, {})},
    )  # fmt: skip


class VerlConfig(dict):
    """verl's ActorConfig as its DPPO functions read it."""

    def __init__(self, low: float, high: float, cap: float):
        super().__init__(clip_ratio_c=cap)
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = low, low, high
        self.global_batch_info = {}


def random_case(seed: int, shape: tuple[int, int]):
    """Log-probs of a policy and an anchor (some moved far, some ratios extreme), advantages of
    both signs (none exactly 0), and a mask with padding and tool tokens."""
    g = torch.Generator().manual_seed(seed)
    anchor = -torch.rand(shape, generator=g) * 3  # probabilities 0.05 .. 1
    moved = torch.randn(shape, generator=g) * torch.where(torch.rand(shape, generator=g) < 0.3, 3.0, 0.3)
    logprobs = (anchor + moved).clamp(max=-1e-4)
    advantages = torch.randn(shape[0], generator=g).sign() * (0.1 + torch.rand(shape[0], generator=g))
    mask = (torch.rand(shape, generator=g) < 0.8).float()
    mask[0, -2:] = 0  # padding
    return logprobs, anchor, advantages, mask


CASES = [
    (seed, shape, divergence)
    for seed, shape in enumerate([(4, 7), (8, 16), (3, 40)])
    for divergence in ("tv", "kl")
]


@pytest.mark.parametrize("seed, shape, divergence", CASES)
def test_dppo_with_the_old_anchor_is_verls(seed, shape, divergence):
    peer = verl()[f"compute_policy_loss_dppo_{divergence}"]
    logprobs, old, advantages, mask = random_case(seed, shape)
    low, high, cap = (0.15, 0.2, 3.0) if divergence == "tv" else (0.05, 0.08, 3.0)
    mine_lp, theirs_lp = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
    settings = PolicyLossSettings(kind="dppo", dppo_divergence=divergence, dppo_delta_low=low,
                                  dppo_delta_high=high, dppo_anchor="old", dppo_ratio_cap=cap)  # fmt: skip
    mine, metrics = policy_loss(mine_lp, old, advantages, mask, mask.sum(), settings)
    theirs, their_metrics = peer(old, theirs_lp, advantages[:, None].expand(shape), mask, "token-mean",
                                 VerlConfig(low, high, cap))  # fmt: skip
    mine.backward(), theirs.backward()
    # the same gradient, token by token: verl writes -A sg(min(r, cap)) log p, rltrain -A min(r, cap)
    # with the cap's gradient through log p; values differ by that form, gradients do not
    torch.testing.assert_close(mine_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-7)
    masked = (metrics["dppo_masked_low"] + metrics["dppo_masked_high"]) / metrics["tokens"]
    assert masked.item() == pytest.approx(their_metrics["actor/pg_clipfrac"], abs=1e-6)
    assert 0 < masked < 1  # the cases mask some tokens, not all


@pytest.mark.parametrize("seed, shape, divergence", CASES)
def test_dppo_with_the_rollout_anchor_is_skyrls(seed, shape, divergence):
    peer = skyrl()["dppo_policy_loss"]
    logprobs, rollout, advantages, mask = random_case(seed, shape)
    low, high = (0.2, 0.15) if divergence == "tv" else (0.05, 0.03)
    config = SimpleNamespace(dppo=SimpleNamespace(dppo_type=f"binary_{divergence}", delta_low=low, delta_high=high),
                             off_policy_correction=None)  # fmt: skip
    advantages_BT = advantages[:, None].expand(shape).contiguous()
    old = logprobs.detach() + 0.01  # (SkyRL's anchor is the rollout's: the old policy is unused)
    mine_lp, theirs_lp = logprobs.clone().requires_grad_(), logprobs.clone().requires_grad_()
    per_token, masked_low, masked_high = dppo_loss(mine_lp, rollout, advantages_BT, divergence, low, high)
    theirs, metrics = peer(theirs_lp, old, advantages_BT, config, mask, rollout)
    # per token: the same loss (SkyRL sums its tokens; one token at a time gives each)
    for b, t in [(b, t) for b in range(shape[0]) for t in range(shape[1])][:: max(1, shape[1] // 3)]:
        one = torch.zeros(shape)
        one[b, t] = 1.0
        assert peer(logprobs, old, advantages_BT, config, one, rollout)[0].item() == pytest.approx(
            per_token[b, t].item(), rel=1e-6, abs=1e-7
        )
    settings = PolicyLossSettings(
        kind="dppo", dppo_divergence=divergence, dppo_delta_low=low, dppo_delta_high=high
    )
    mine, _ = policy_loss(mine_lp, old, advantages, mask, 1.0, settings, generator_logprobs_BT=rollout)
    torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)  # the token sum, as SkyRL reduces it
    mine.backward(), theirs.backward()
    torch.testing.assert_close(mine_lp.grad, theirs_lp.grad, rtol=1e-5, atol=1e-7)
    share = ((masked_low | masked_high).float() * mask).sum() / mask.sum()
    assert share.item() == pytest.approx(metrics["clip_ratio"], abs=1e-6)


@pytest.mark.parametrize("seed, shape, divergence", CASES[:4])
def test_dppo_against_the_engine_corrects_for_it_once_and_against_the_old_policy_as_verl(
    seed, shape, divergence
):
    # The engine's log-probs differ from the old policy's (N(0, 0.5) per token); rltrain's default
    # correction (truncated weights min(pi_old / pi_rollout, 2)) is on. Against the rollout anchor
    # the ratio p / p_rollout is the whole importance weight: the loss is SkyRL's with no
    # correction (its default), not that times the weight again. Against the old anchor the weight
    # corrects for the engine: the loss is verl's with its rollout_is_weights ("token", threshold 2)
    logprobs, old, advantages, mask = random_case(seed, shape)
    rollout = old + 0.5 * torch.randn(shape, generator=torch.Generator().manual_seed(seed + 100))
    rollout = rollout.clamp(max=-1e-4)
    low, high = (0.15, 0.2) if divergence == "tv" else (0.05, 0.08)
    correction = RolloutCorrection("tis", cap=2.0)

    def mine(anchor: str, cap: float | None = None):
        lp = logprobs.clone().requires_grad_()
        settings = PolicyLossSettings(kind="dppo", dppo_divergence=divergence, dppo_delta_low=low, dppo_delta_high=high,
                                      dppo_anchor=anchor, dppo_ratio_cap=cap, correction=correction)  # fmt: skip
        loss, _ = policy_loss(lp, old, advantages, mask, mask.sum(), settings, generator_logprobs_BT=rollout)
        loss.backward()
        return loss, lp.grad

    advantages_BT = advantages[:, None].expand(shape).contiguous()
    config = SimpleNamespace(dppo=SimpleNamespace(dppo_type=f"binary_{divergence}", delta_low=low, delta_high=high),
                             off_policy_correction=None)  # fmt: skip
    theirs_lp = logprobs.clone().requires_grad_()
    theirs, _ = skyrl()["dppo_policy_loss"](theirs_lp, old, advantages_BT, config, mask, rollout)
    (theirs / mask.sum()).backward()
    loss, grad = mine("rollout")
    torch.testing.assert_close(loss, theirs / mask.sum(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, theirs_lp.grad, rtol=1e-5, atol=1e-7)

    peers = verl()
    weights, _ = peers["compute_rollout_correction_weights"](old - rollout, mask, "token", 2.0)
    theirs_lp = logprobs.clone().requires_grad_()
    theirs, _ = peers[f"compute_policy_loss_dppo_{divergence}"](
        old,
        theirs_lp,
        advantages_BT,
        mask,
        "token-mean",
        VerlConfig(low, high, 3.0),
        rollout_is_weights=weights,
    )
    theirs.backward()
    _, grad = mine("old", cap=3.0)
    torch.testing.assert_close(grad, theirs_lp.grad, rtol=1e-5, atol=1e-7)  # (verl's value is log p-weighted)
    assert (weights[mask.bool()] != 1).float().mean() > 0.5  # the weights do change the loss


def test_dppo_with_one_bound_set_uses_it_on_both_sides():
    # delta_high unset is delta_low (the config's help), not the divergence's default (0.15):
    # p_a = 0.5; a token moved up to 0.6 (+0.1) with A > 0 is masked by a bound of 0.05 on both
    # sides, as is one moved down to 0.4 with A < 0
    anchor = torch.tensor([[0.5, 0.5]]).log()
    logprobs = torch.tensor([[0.6, 0.4]]).log()
    advantages = torch.tensor([[1.0, -1.0]])
    low, high = dppo_mask(logprobs, anchor, advantages, "tv", delta_low=0.05)
    assert low.tolist() == [[False, True]] and high.tolist() == [[True, False]]
    low, high = dppo_mask(logprobs, anchor, advantages, "tv", delta_low=0.12)  # 0.1 within both
    assert not low.any() and not high.any()
