"""Learners do only the work that moves the weights: a sequence whose every loss token has
advantage exactly 0 has a zero gradient under the policy losses (each is the advantage times a
function of the log-probs), so it is counted in the step's denominators but not run
(``learner.skip_zero_gradient``, rltrain.learner.group). The update with the skip is the update
without it on real Ray + DeepSpeed learners, over losses, aggregations and layouts; dropping those
sequences from the batch instead (their tokens out of the denominators) changes it; every term that
reads them turns the skip off."""

import pytest
import torch

from rltrain.config import Config, load_config
from rltrain.diagnostics import layout_config, relative_difference, synthetic_rollouts

SKIPPED = [0, 1, 2, 3, 6]  # the first group of 4 (equal rewards), and one sequence at its group's mean


def with_zero_advantages(group_size: int = 4):
    """8 sequences in groups of 4 sharing a prompt; 5 of them with advantage exactly 0."""
    batch = synthetic_rollouts(group_size=group_size)
    advantages = batch.advantages.clone()
    advantages[SKIPPED] = 0.0
    return batch.replace(advantages=advantages)


# (loss section, learner layout): the losses and advantages' aggregations over layouts
CASES = {
    "GRPO token-mean, ZeRO-2, packed rows and trees, 2 mini-batches": (
        {}, dict(zero_stage=2, max_tokens_per_micro_batch=24, prefix_sharing=True, num_mini_batches=2)),
    "Dr. GRPO seq-mean-token-sum-norm, ZeRO-3, padded": (
        {"aggregation": "seq-mean-token-sum-norm"}, dict(zero_stage=3, micro_batch_size=2)),
    "GSPO seq-mean-token-mean, ZeRO-2, packed": (
        {"kind": "gspo", "aggregation": "seq-mean-token-mean"}, dict(zero_stage=2, max_tokens_per_micro_batch=20)),
    "CISPO, ZeRO-3, packed rows and trees": (
        {"kind": "cispo"}, dict(zero_stage=3, max_tokens_per_micro_batch=30, prefix_sharing=True)),
    "DPPO, ZeRO-2, padded, 2 PPO epochs": (
        {"kind": "dppo"}, dict(zero_stage=2, micro_batch_size=3, ppo_epochs=2)),
}  # fmt: skip


def case_config(case: str, skip: bool) -> Config:
    loss, learner = CASES[case]
    learner = dict(learner)
    micro, zero = learner.pop("micro_batch_size", 4), learner.pop("zero_stage")
    return layout_config(2, micro, zero, loss=loss, skip_zero_gradient=skip, **learner)


@pytest.mark.slow
def test_skipping_zero_gradient_sequences_leaves_the_update_as_it_is_and_dropping_them_does_not(
    ray_local, kept_learners, tiny_model_path
):
    # each case: with the skip, without it, and the control trained on the batch without those
    # sequences (their tokens and sequences out of every denominator); two learners a case, one
    # group of processes restarted between the configs. Last, a batch with nothing to run (every
    # advantage 0) under ZeRO-3: blank micro-batches on every rank, every collective alike, no step
    from rltrain.diagnostics import on_learners

    batch = with_zero_advantages()
    nothing = batch.replace(advantages=torch.zeros(len(batch)))
    kept = torch.tensor([i for i in range(len(batch)) if i not in SKIPPED])
    configs, batches = [], []
    for case in CASES:
        configs += [case_config(case, True), case_config(case, False), case_config(case, True)]
        batches += [batch, batch, batch.select(kept)]
    configs.append(case_config("CISPO, ZeRO-3, packed rows and trees", True))
    batches.append(nothing)

    def one_step(group, i):
        before = group.state_dict()
        metrics = group.train_step(batches[i])
        after = group.state_dict()
        return {k: after[k] - before[k] for k in before}, metrics

    results = on_learners(configs, tiny_model_path, one_step)
    updates = [update for update, _ in results]
    for i, case in enumerate(CASES):
        skipped, full, dropped = updates[3 * i : 3 * i + 3]
        gap, control = relative_difference(skipped, full), relative_difference(dropped, full)
        print(f"{case}: skip vs none {gap:.2e}, dropped from the denominators {control:.2e}")
        assert gap < 1e-6 and control > 1e-2, (case, gap, control)
        # the share not run: 5 of the 8 sequences; none without the skip
        assert results[3 * i][1]["perf/skipped_sequences"] == pytest.approx(5 / 8)
        assert "perf/skipped_sequences" not in results[3 * i + 1][1]
    assert results[-1][1]["perf/skipped_sequences"] == 1.0
    assert max(v.abs().max().item() for v in updates[-1].values()) == 0.0  # plain SGD: no gradient, no step


def test_every_term_that_reads_a_sequence_of_advantage_zero_turns_the_skip_off():
    # the proof on each learner (rltrain.learner.policy.PolicyLearner.zero_gradient_proof): the KL to
    # a reference, the load-balancing loss, a critic's or a teacher's per-token advantages, a
    # rejecting correction, per-micro-batch means, the warm start's own loss, the key itself
    from rltrain.learner.policy import PolicyLearner
    from rltrain.learner.sft import SFTLearner

    def proof(*overrides: str, learner=PolicyLearner, moe_coef: float = 0.0):
        one = learner(load_config("configs/cpu_demo.yaml", list(overrides)), "unused", 0, 1)
        one.moe_coef = moe_coef  # (set from the model's routers at its start)
        return one.zero_gradient_proof()

    assert proof() is None
    assert proof("loss.kind=gspo", "algorithm.advantage=rloo", "loss.aggregation=seq-mean-token-mean") is None
    refused = {
        "loss.kl_beta > 0": proof("loss.kl_beta=0.01"),
        "load-balancing loss": proof(moe_coef=0.01),
        "algorithm.advantage=gae": proof("algorithm.advantage=gae", "critic.model=null"),
        "rejecting rollout correction": proof("loss.rollout_correction={kind: mis, level: token, low: 0.5, high: 2.0}"),
        "per-micro-batch means": proof("loss.masked_mean_denominator=null"),
        "learner.skip_zero_gradient=false": proof("learner.skip_zero_gradient=false"),
        "the warm start's own loss": proof(learner=SFTLearner),
    }  # fmt: skip
    for fragment, why in refused.items():
        assert why is not None and fragment in why, (fragment, why)


@pytest.mark.slow
def test_through_the_cli_a_run_that_skips_ends_with_the_weights_of_one_that_does_not(tmp_path, ray_cluster):
    # the demo's task with a reward under which about half of the groups tie (tests/reward_fns.py),
    # 2 steps of plain SGD on 2 learners under ZeRO-3 with packed rows and trees: the same final
    # weights with and without the skip, and the skipped share logged
    from test_e2e import TESTS_ON_PATH, final_weights, logged_rows, run_trainer

    common = ["run.steps=2", "reward.functions={reward_fns:tied_reward: 1.0}", "learner.optimizer=sgd",
              "learner.lr=0.5", "learner.max_grad_norm=0", "learner.warmup_steps=0", "learner.zero_stage=3",
              "learner.prefix_sharing=true", "algorithm.overlong=none", "rollout.backend=hf"]  # fmt: skip
    env = {**TESTS_ON_PATH, **ray_cluster}
    run_trainer(tmp_path / "skip", *common, env=env)
    run_trainer(tmp_path / "all", *common, "learner.skip_zero_gradient=false", env=env)
    skipped, every = final_weights(tmp_path / "skip"), final_weights(tmp_path / "all")
    worst = max((skipped[k] - every[k]).abs().max().item() for k in every)
    shares = [row["perf/skipped_sequences"] for row in logged_rows(tmp_path / "skip")]
    print(f"skipped shares {shares}; worst weight gap {worst:.2e}")
    assert worst < 1e-6 and min(shares) > 0
    assert all("perf/skipped_sequences" not in row for row in logged_rows(tmp_path / "all"))
