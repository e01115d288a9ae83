"""Learner actors on real Ray + DeepSpeed: layout invariance, checkpoints, metrics."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rltrain.batch import TrainBatch
from rltrain.config import Config
from rltrain.diagnostics import (
    critic_layout_config,
    layout_config,
    learners,
    metrics_of_one_step,
    relative_difference,
    synthetic_rollouts,
    updates_after_one_step,
    with_value_targets,
)
from rltrain.forward import sequence_logprobs
from rltrain.learner.critic import CriticLearner
from rltrain.learner.group import LearnerGroup, placement_of
from rltrain.learner.policy import PolicyLearner
from rltrain.loss.logprobs import token_entropy
from rltrain.plan import plan_packed_micro_batches

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("kept_learners")]


# (learners, micro-batch size): 2 x 2 micro-batches of 2; 2 x (3 + 1), under ZeRO 0, 2 and 3
SPLITS = {"2x2": (2, 2), "2x3+1": (2, 3)}


def test_token_mode_update_is_layout_invariant(ray_local, tiny_model_path):
    # the reference: 1 learner x 4 micro-batches of 2, each sequence's prompt computed in its own
    # row; 2x3+1 under every ZeRO stage and 2x2 under ZeRO-0 give its update with each
    # micro-batch's shared prompts computed once (groups of 4 share a prompt;
    # learner.prefix_sharing=true), and the per-micro-batch mean does not (1x4 against 2x3+1; 1x4
    # and 2x2 hold the same pairs of sequences per micro-batch, so the naive mean would agree there:
    # 2x3+1, whose micro-batches differ in size, is the split that tells the means apart)
    batch = synthetic_rollouts(group_size=4)
    layouts = {f"ZeRO-{stage} {name}": layout_config(*split, stage, prefix_sharing=True)
               for stage in (0, 2, 3) for name, split in SPLITS.items() if stage == 0 or name != "2x2"}  # fmt: skip
    naive = [
        layout_config(1, 2, 0, None, prefix_sharing=True),
        layout_config(2, 3, 2, None, prefix_sharing=True),
    ]
    reference, *updates, naive_one, naive_split = updates_after_one_step(
        [layout_config(1, 2, 0, prefix_sharing=False), *layouts.values(), *naive], tiny_model_path, batch
    )
    token_diffs = {name: relative_difference(update, reference) for name, update in zip(layouts, updates)}
    naive_diff = relative_difference(naive_split, naive_one)
    print(
        f"token-mode update differences vs 1x4 {token_diffs}; per-micro-batch mode 2x3+1 vs 1x4: {naive_diff:.3e}"
    )
    assert max(token_diffs.values()) < 1e-5, token_diffs
    assert naive_diff > 1e-2, naive_diff


def test_uneven_batch_is_trained_in_full(ray_local, tiny_model_path):
    # 7 sequences on 2 learners with micro-batches of 3: shares 4 and 3, micro-batches (3, 1) and (3, pad);
    # the update must equal one learner taking all 7 in one micro-batch
    batch = synthetic_rollouts(n=7, seed=3)
    split, whole = updates_after_one_step(
        [layout_config(2, 3, 2), layout_config(1, 7, 0)], tiny_model_path, batch
    )
    assert relative_difference(split, whole) < 1e-5


def test_a_restarted_group_gives_a_fresh_group_s_update(ray_local, tiny_model_path, kept_learners):
    # updates_after_one_step runs the configs of a placement in one group of processes, restarted
    # between them: nothing of the config before may survive a restart (the weights it moved,
    # AdamW's moments, the schedule's step, ZeRO-3's partitioned parameters and its head-chunk
    # agreement, the sequence-parallel group). After an AdamW step under ZeRO-3 with sp=2, the
    # restarted group's SGD step under ZeRO-0 is the fresh group's, bit for bit (the same sums in
    # the same order); without the restart it would start from weights AdamW moved by ~1e-2 each
    batch = synthetic_rollouts()
    before = layout_config(2, 1, 3, optimizer="adamw", lr=1e-2, max_tokens_per_micro_batch=70,
                           sequence_parallel_size=2)  # fmt: skip
    after = layout_config(2, 2, 0)
    kept_learners.close()  # (their CPUs back: the two groups below start in new processes)

    def update(group: LearnerGroup) -> dict[str, torch.Tensor]:
        start = group.state_dict()
        group.train_step(batch)
        return {k: v - start[k] for k, v in group.state_dict().items()}

    groups = [
        LearnerGroup(c, tiny_model_path, total_optimizer_steps=1) for c in (after, before)
    ]  # new processes
    try:
        fresh = update(groups[0])
        group = groups[1]
        group.train_step(batch)
        with pytest.raises(ValueError, match="restart where they are placed"):
            group.restart(layout_config(1, 2, 0), total_optimizer_steps=1)  # one learner, not two
        group.restart(after, total_optimizer_steps=1)
        restarted = update(group)
    finally:
        for group in groups:
            group.shutdown()
    for name in fresh:
        torch.testing.assert_close(restarted[name], fresh[name], rtol=0, atol=0)


# other layouts the checkpoint of 2 learners with ZeRO-2 is resumed on, from its layout-free state
ELASTIC = {
    "policy": [
        {"num_learners": 1, "zero_stage": 3},
        {
            "num_learners": 2,
            "zero_stage": 1,
            "sequence_parallel_size": 2,
            "packing": True,
            "max_tokens_per_micro_batch": 64,
        },
    ],  # fmt: skip
    "critic": [{"num_learners": 1, "zero_stage": 0}],
}


@pytest.mark.parametrize("learner", ["policy", "critic"])
def test_checkpoint_round_trip_continues_exactly_on_its_own_layout_and_others(
    learner, ray_local, tiny_model_path, tmp_path
):
    settings = dict(optimizer="adamw", lr=1e-2, warmup_steps=2, lr_schedule="linear", max_grad_norm=1.0)
    make_config, learner_cls = {
        "policy": (layout_config, PolicyLearner),
        "critic": (critic_layout_config, CriticLearner),
    }[learner]
    config = make_config(2, 2, 2, **settings)
    # (the policy ignores the value targets the critic trains on)
    first = with_value_targets(synthetic_rollouts(seed=1), seed=1)
    second = with_value_targets(synthetic_rollouts(seed=2), seed=2)
    with learners(config, tiny_model_path, 4, learner_cls) as group:
        group.train_step(first)
        group.save_checkpoint(tmp_path, "step1", {"step": 1})
        group.train_step(second)
        uninterrupted = group.state_dict()

        def resumed_from(fresh) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
            assert fresh.load_checkpoint(tmp_path, "step1") == {"step": 1}
            return fresh.train_step(second), fresh.state_dict()

        def resumed_on(layout: Config) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
            # a layout of as many learners resumes in the same processes, restarted (their weights
            # back to the model's, then the checkpoint's), any other in other ones
            if placement_of(learner_cls.section(layout)) == placement_of(learner_cls.section(config)):
                group.restart(layout, total_optimizer_steps=4)
                return resumed_from(group)
            with learners(layout, tiny_model_path, 4, learner_cls) as fresh:
                return resumed_from(fresh)

        metrics, resumed = resumed_on(config)  # DeepSpeed's own checkpoint
        # the learning rate after 1 of 2 warm-up steps proves the scheduler state came back: 1e-2 * 1/2
        assert metrics[f"{learner_cls.PREFIX}/lr"] == pytest.approx(5e-3)
        for name in uninterrupted:  # the same layout: the same sums in the same order
            torch.testing.assert_close(resumed[name], uninterrupted[name], rtol=0, atol=1e-7)
        for changes in ELASTIC[learner]:
            raw = config.model_dump()
            (raw["learner"] if learner == "policy" else raw["critic"]["learners"]).update(changes)
            metrics, resumed = resumed_on(Config.model_validate(raw))
            # AdamW's second update depends on the first step's moments and on the schedule: a resume
            # that lost the moments moves each weight by ~lr = 5e-3 in another direction. The layouts
            # sum the same gradients in another order, and Adam divides tiny gradients by their own
            # tiny scale, so rounding shows up to a few 1e-6 (the bound: 1e-5)
            assert metrics[f"{learner_cls.PREFIX}/lr"] == pytest.approx(5e-3), changes
            worst = max((resumed[k] - uninterrupted[k]).abs().max().item() for k in uninterrupted)
            print(f"resumed on {changes}: largest difference {worst:.1e}")
            assert worst < 1e-5, (changes, worst)


def test_a_save_one_rank_cannot_write_fails_on_every_rank_and_the_group_trains_on(
    ray_local, tiny_model_path, tmp_path
):
    # 2 ranks under ZeRO-2: rank 1 alone writes its optimizer shard; a folder where that file
    # goes makes its write fail while rank 0's succeed. DeepSpeed's save ends in a barrier that a
    # rank raising out of it would leave its peer waiting in.
    config = layout_config(2, 2, 2, optimizer="adamw")
    with learners(config, tiny_model_path, total_optimizer_steps=3) as group:
        group.train_step(synthetic_rollouts(seed=1))
        shard = tmp_path / "blocked" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        shard.mkdir(parents=True)
        error = group.save_checkpoint(tmp_path, "blocked", {"step": 1})
        assert error is not None and str(shard) in error and "Is a directory" in error, error
        # the ranks left the save together: the next update and a save elsewhere go through
        group.train_step(synthetic_rollouts(seed=2))
        assert group.save_checkpoint(tmp_path, "written", {"step": 2}) is None
        assert (tmp_path / "written" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()


def test_logged_metrics_are_global_token_means(ray_local, tiny_model_path):
    batch = synthetic_rollouts(n=9, seed=4)
    metrics = metrics_of_one_step(layout_config(2, 2, 2), tiny_model_path, batch)

    # recompute in this process, on the whole batch, with the initial weights
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    keep = batch.response_mask.bool() & batch.tool_mask.bool()
    with torch.no_grad():
        logits = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp(min=0),
        ).logits
    entropy = torch.cat([torch.zeros(9, 1), token_entropy(logits[:, :-1])], dim=1)
    logprobs, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
    assert torch.isfinite(logprobs).all()
    # on-policy (ratio 1): PPO's per-token loss is -A; the global token mean weights every token once
    advantages = batch.advantages[:, None].expand_as(keep)
    expected_pg = -(advantages[keep]).sum() / keep.sum()
    assert metrics["train/tokens"] == keep.sum().item()
    assert metrics["train/pg_loss"] == pytest.approx(expected_pg.item(), rel=1e-5)
    assert metrics["train/entropy"] == pytest.approx(entropy[keep].mean().item(), rel=1e-5)
    assert metrics["train/clip_fraction"] == 0.0
    assert metrics["train/grad_norm"] > 0


def test_several_optimizer_steps_per_batch_use_the_pre_update_policy_and_stay_invariant(
    ray_local, tiny_model_path
):
    # 2 mini-batches = 2 optimizer steps on one batch: the second is taken at updated weights, so its
    # ratio to the old (pre-update) log-probs moves away from 1; the layout still does not matter
    batch = synthetic_rollouts(n=8, seed=5)
    updates, metrics = {}, {}
    for name, (ranks, micro) in {"1x2": (1, 2), "2x3": (2, 3)}.items():
        config = layout_config(ranks, micro, 2, num_mini_batches=2)
        with learners(config, tiny_model_path, total_optimizer_steps=2) as group:
            before = group.state_dict()
            metrics[name] = group.train_step(batch)
            after = group.state_dict()
        updates[name] = {k: after[k] - before[k] for k in before}
    assert metrics["1x2"]["train/optimizer_steps"] == 2
    assert abs(metrics["1x2"]["train/ratio"] - 1.0) > 1e-4
    assert relative_difference(updates["2x3"], updates["1x2"]) < 1e-5


def test_packed_update_equals_padded_and_single_micro_batch_update(ray_local, tiny_model_path):
    # synthetic rollouts: 8 sequences of 4-14 tokens, tool tokens, one all-masked sequence; a budget
    # of 16 tokens gives one or two sequences per micro-batch, 200 puts each rank's share in one.
    # Under ZeRO-0 one learner; under ZeRO-2 and 3 two (one rank partitions nothing). Padded 2x3
    # under ZeRO-0 beside them (under ZeRO-2 and 3: test_token_mode_update_is_layout_invariant).
    # Groups of 4 share a prompt: budget 200 packs them as prefix trees (learner.prefix_sharing=true)
    batch = synthetic_rollouts(group_size=4)
    layouts = {"ZeRO-0 padded 2x3": layout_config(2, 3, 0, prefix_sharing=False)}
    layouts |= {f"ZeRO-{stage} packed {learners} learners, budget {budget}":
                layout_config(learners, 1, stage, max_tokens_per_micro_batch=budget, prefix_sharing=budget > 16)
                for stage in (0, 2, 3) for learners in ((1,) if stage == 0 else (2,))
                for budget in (16, 200)}  # fmt: skip
    # the reference: one learner, all 8 sequences in one padded micro-batch, unshared
    reference, *updates = updates_after_one_step(
        [layout_config(1, 8, 0, prefix_sharing=False), *layouts.values()], tiny_model_path, batch
    )
    diffs = {name: relative_difference(update, reference) for name, update in zip(layouts, updates)}
    print(f"relative update differences {diffs}")
    assert max(diffs.values()) < 1e-5, diffs


def test_packed_micro_batches_break_the_per_micro_batch_mean(ray_local, tiny_model_path):
    # control: the per-micro-batch mean weights a token by its micro-batch's size, so packing the
    # same batch under a small budget changes the update visibly
    batch = synthetic_rollouts()
    one, packed = updates_after_one_step(
        [layout_config(1, 8, 0, None), layout_config(2, 1, 0, None, max_tokens_per_micro_batch=16)],
        tiny_model_path, batch,
    )  # fmt: skip
    assert relative_difference(packed, one) > 1e-2


def budget_for(batch, data_parallel: int, micro_batches: int) -> int:
    """The smallest token budget that packs the batch into ``micro_batches`` per rank."""
    lengths = batch.sequence_lengths()
    for budget in range(int(lengths.max()), int(lengths.sum()) + 1):
        if plan_packed_micro_batches(lengths, data_parallel, 1, budget).micro_batches_per_group() == [
            micro_batches
        ]:
            return budget
    raise ValueError(f"no budget gives {micro_batches} micro-batches on {data_parallel} ranks")


# sequence parallelism (sp=2) under each data-parallel size, with one micro-batch per optimizer
# step and with several; packed layouts without it (sp=1) are
# test_packed_update_equals_padded_and_single_micro_batch_update's
SP_LAYOUTS = [(2, 1, 1), (2, 2, 1), (2, 1, 4)]


# under ZeRO-2 sequence parallelism alone, beside data parallelism and beside accumulation; under
# ZeRO-3 (the same arithmetic, partitioned parameters) the three together, sp with accumulation
# and accumulation alone
@pytest.mark.parametrize(
    "zero_stage, layouts", [(2, SP_LAYOUTS), (3, [(2, 2, 4), (2, 1, 2), (1, 2, 2)])], ids=["2", "3"]
)
def test_sequence_parallel_update_is_exact_under_sp_dp_and_accumulation(
    zero_stage, layouts, ray_local, tiny_model_path
):
    # 12 sequences of 5-14 tokens: packed rows of several documents, tool tokens, an all-masked
    # sequence; every layout of sp x dp learners x micro-batches per optimizer step gives the
    # one-learner, one-micro-batch update
    batch = synthetic_rollouts(n=12)
    configs = [layout_config(sp * dp, 1, zero_stage, max_tokens_per_micro_batch=budget_for(batch, dp, acc),
                             sequence_parallel_size=sp) for sp, dp, acc in layouts]  # fmt: skip
    reference, *updates = updates_after_one_step([layout_config(1, 12, 0), *configs], tiny_model_path, batch)
    diffs = {f"sp{sp} dp{dp} acc{acc}": relative_difference(update, reference)
             for (sp, dp, acc), update in zip(layouts, updates)}  # fmt: skip
    print(f"ZeRO-{zero_stage}: relative update differences {diffs}")
    assert max(diffs.values()) < 1e-5, diffs


def test_sequence_parallel_with_per_micro_batch_means_changes_the_update(ray_local, tiny_model_path):
    # the verl Ulysses failure: per-micro-batch normalization under SP + accumulation differs visibly
    batch = synthetic_rollouts()
    config = layout_config(
        2, 1, 2, None, max_tokens_per_micro_batch=budget_for(batch, 1, 4), sequence_parallel_size=2
    )
    one, sp = updates_after_one_step([layout_config(1, 8, 0, None), config], tiny_model_path, batch)
    assert relative_difference(sp, one) > 1e-2


def straddling_rollouts() -> TrainBatch:
    """5 sequences of 14 tokens (prompt 5, completion 9), one all-masked, tool tokens: packed into one
    70-token row split over 2 sequence-parallel ranks at token 35, the third sequence's completion
    lies on both ranks (synthetic_rollouts' short completions never straddle the cut)."""
    batch = synthetic_rollouts(n=5)
    full = torch.ones_like(batch.attention_mask)
    response = (torch.arange(14) >= 5).long().expand_as(full).clone()
    response[3] = 0
    g = torch.Generator().manual_seed(5)
    # old log-probs away from the policy's (~ -5.5 on 256 tokens): GSPO's sequence ratios matter
    return batch.replace(attention_mask=full, response_mask=response,
                         old_logprobs=-5.5 + 0.5 * torch.randn(full.shape, generator=g))  # fmt: skip


# the per-sequence aggregations through real learners, each under one ZeRO stage (0, 2, 3 in turn:
# the stage partitions what the aggregation computed, test_token_mode_update_is_layout_invariant
# crosses them), padded, packed and sequence parallel, each against one learner holding the whole
# batch in one micro-batch
PER_SEQUENCE_CASES = [
    ("seq-mean-token-mean", 3),
    ("seq-mean-token-sum", 0),
    ("seq-mean-token-sum-norm", 2),
]


@pytest.mark.parametrize("aggregation, zero_stage", PER_SEQUENCE_CASES)
def test_per_sequence_aggregations_are_exact_padded_packed_and_sequence_parallel(
    aggregation, zero_stage, ray_local, tiny_model_path
):
    batch = straddling_rollouts()
    loss = {"aggregation": aggregation}
    layouts = {
        "padded 2 learners x micro-batch 2": layout_config(2, 2, zero_stage, loss=loss),
        "packed 2 learners, budget 16": layout_config(
            2, 1, zero_stage, max_tokens_per_micro_batch=16, loss=loss
        ),
        "sp2, one row": layout_config(
            2, 1, zero_stage, max_tokens_per_micro_batch=70, sequence_parallel_size=2, loss=loss
        ),  # fmt: skip
    }
    # control: each micro-batch divided by its own sequence count
    control = layout_config(2, 2, zero_stage, None, loss=loss)
    reference, naive, *updates = updates_after_one_step(
        [layout_config(1, 5, 0, loss=loss), control, *layouts.values()], tiny_model_path, batch
    )
    diffs = {name: relative_difference(update, reference) for name, update in zip(layouts, updates)}
    naive_diff = relative_difference(naive, reference)
    print(f"{aggregation}, ZeRO-{zero_stage}: {diffs}; per-micro-batch control {naive_diff:.3e}")
    assert max(diffs.values()) < 1e-5, diffs
    assert naive_diff > 1e-2, naive_diff


def test_gspo_under_sequence_parallelism_uses_each_whole_sequence_ratio(ray_local, tiny_model_path):
    # the straddling sequence's ratio needs its log-ratios from both ranks (one all-reduce in the
    # sp group); with a rank's own part alone the update is ~1e-3 off (wide clips: nothing clipped)
    batch = straddling_rollouts()
    loss = {"kind": "gspo", "clip_low": 10.0, "clip_high": 10.0, "aggregation": "seq-mean-token-mean"}
    sp = layout_config(2, 1, 2, max_tokens_per_micro_batch=70, sequence_parallel_size=2, loss=loss)
    reference, update = updates_after_one_step(
        [layout_config(1, 5, 0, loss=loss), sp], tiny_model_path, batch
    )
    diff = relative_difference(update, reference)
    assert diff < 1e-5, diff


def off_policy_rollouts(model_path: str, seed: int) -> tuple[TrainBatch, torch.Tensor]:
    """:func:`straddling_rollouts` (no old log-probs) sampled by an engine whose log-probs are the
    learner's off by N(0, 0.8), and the learner's own."""
    batch = straddling_rollouts().replace(old_logprobs=None)
    model = AutoModelForCausalLM.from_pretrained(model_path)
    learner_logprobs = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0)[0].detach()
    g = torch.Generator().manual_seed(seed)
    noise = 0.8 * torch.randn(learner_logprobs.shape, generator=g)
    return batch.replace(generator_logprobs=learner_logprobs + noise), learner_logprobs


# rejecting rollout corrections through real learners: a token rule and a sequence rule (whose
# straddling sequence is judged whole across the two sequence-parallel ranks)
REJECTING = [
    {"kind": "mis", "level": "token", "low": 0.5, "high": 2.0},
    {"kind": "geo_mask", "level": "sequence", "low": 0.8, "high": 1.25},
]


@pytest.mark.parametrize("correction", REJECTING, ids=["mis-token", "geo_mask-sequence"])
def test_rejected_tokens_leave_the_loss_and_the_token_totals_under_every_layout(
    correction, ray_local, tiny_model_path
):
    from rltrain.loss.corrections import RolloutCorrection, correction_mask

    # an engine whose log-probs are off by N(0, 0.8): a token ratio leaves [0.5, 2] with chance ~0.4
    batch, learner_logprobs = off_policy_rollouts(tiny_model_path, seed=3)
    keep = batch.response_mask.bool() & batch.tool_mask.bool()
    accept = correction_mask(
        learner_logprobs, batch.generator_logprobs, keep, RolloutCorrection(**correction)
    )
    assert 0 < accept.sum() < keep.sum()  # some tokens are rejected, some kept
    # reference: no correction at all, the rejected tokens masked out by hand before training, so
    # that they count in no loss and no token total
    by_hand = batch.replace(tool_mask=batch.tool_mask * accept)
    uncorrected = layout_config(1, 5, 0, loss={"rollout_correction": None})
    loss = {"rollout_correction": correction}
    layouts = {  # (the one-learner layout is each of these with the cuts taken away)
        "padded 2 learners x micro-batch 2": layout_config(2, 2, 2, loss=loss),
        "packed 2 learners, budget 16": layout_config(2, 1, 2, max_tokens_per_micro_batch=16, loss=loss),
        "sp2, one row": layout_config(
            2, 1, 2, max_tokens_per_micro_batch=70, sequence_parallel_size=2, loss=loss
        ),
    }
    # control: the same batch without the correction trains on the rejected tokens too
    reference, control, *updates = updates_after_one_step(
        [uncorrected, uncorrected, *layouts.values()],
        tiny_model_path,
        [by_hand, *[batch] * (len(layouts) + 1)],
    )
    diffs = {name: relative_difference(update, reference) for name, update in zip(layouts, updates)}
    control_diff = relative_difference(control, reference)
    print(f"{correction['kind']}: {diffs}; without the correction {control_diff:.3e}")
    assert max(diffs.values()) < 1e-5, diffs
    assert control_diff > 1e-2, control_diff


def test_dppo_in_token_mode_gives_one_learners_update_in_every_layout(ray_local, tiny_model_path):
    # an engine whose log-probs are off by N(0, 0.8) (the anchor): DPPO masks the tokens the policy
    # moved past the bound, on each side; the masked tokens stay in the token totals (their loss is
    # 0), so 2 learners x 2 micro-batches under ZeRO-2 give one learner's single micro-batch update
    # (Binary-TV through the learners; Binary-KL's mask, checked below beside it, enters them alike)
    from rltrain.loss.dppo import dppo_mask

    batch, learner_logprobs = off_policy_rollouts(tiny_model_path, seed=5)
    keep = batch.response_mask.bool() & batch.tool_mask.bool()
    # the tiny model's probabilities are ~1/260: bounds at that scale mask some tokens on each side
    losses = {d: {"kind": "dppo", "dppo_divergence": d, "dppo_delta_low": delta, "dppo_delta_high": delta}
              for d, delta in (("tv", 1e-3), ("kl", 2e-4))}  # fmt: skip
    for d, loss in losses.items():
        low, high = dppo_mask(learner_logprobs, batch.generator_logprobs, batch.advantages[:, None].expand_as(keep),
                              d, loss["dppo_delta_low"], loss["dppo_delta_high"])  # fmt: skip
        assert 0 < low[keep].sum() and 0 < high[keep].sum() and (low | high)[keep].sum() < keep.sum()
    unmasked = {**losses["tv"], "dppo_delta_low": 1.0, "dppo_delta_high": 1.0}  # (no token moves that far)
    tv, tv_layout, naive, control = updates_after_one_step(
        [layout_config(1, 5, 0, loss=losses["tv"]), layout_config(2, 2, 2, loss=losses["tv"]),
         layout_config(2, 2, 2, None, loss=losses["tv"]), layout_config(1, 5, 0, loss=unmasked)],
        tiny_model_path, batch,
    )  # fmt: skip
    diffs = {"tv": relative_difference(tv_layout, tv)}
    naive_diff, mask_diff = relative_difference(naive, tv), relative_difference(control, tv)
    print(f"dppo: 2 learners x 2 micro-batches {diffs}; per-micro-batch control {naive_diff:.3e}; "
          f"without the mask {mask_diff:.3e}")  # fmt: skip
    assert max(diffs.values()) < 1e-5 and naive_diff > 1e-2, (diffs, naive_diff)
    assert mask_diff > 1e-3, mask_diff  # the mask acts in the learners


def test_reference_logprobs_under_sequence_parallelism_cover_every_rank_s_tokens(ray_local, tiny_model_path):
    # algorithm.kl_in_reward reads the reference's per-token log-probs through LearnerGroup.per_token;
    # with sp=2 each rank computes the tokens it owns (0 elsewhere), and only the first rank's share
    # came back: the straddling row's tokens past the cut got a reference log-prob of 0
    batch = straddling_rollouts()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    expected = sequence_logprobs(model, batch.input_ids, batch.attention_mask, 1.0)[0].detach()
    loss = {"kl_beta": 0.1}  # a reference model on the learners
    config = layout_config(2, 1, 2, max_tokens_per_micro_batch=70, sequence_parallel_size=2, loss=loss)
    with learners(config, tiny_model_path) as group:
        got = group.per_token(batch)
    # every predicted token (from position 1 on) of all 5 rows is the model's, on both ranks' halves
    torch.testing.assert_close(got[:, 1:], expected[:, 1:], rtol=0, atol=1e-5)


def test_zero3_heads_with_a_real_vocabulary_gather_alike_on_ranks_with_uneven_rows(ray_local, tmp_path):
    # a 32,768-token vocabulary: log-probs from hidden states run the head on chunks of 1,024
    # tokens (64 MiB of float32 logits hold 512; HEAD_MIN_CHUNK_ROWS), and under ZeRO-3 each head
    # call gathers its weight, a collective. One group of 4 shares a 5-token prompt: its long
    # sequence (1,400 tokens: two chunks) goes to one rank, the three short ones (one chunk) to the
    # other, as packed rows and as a prefix tree. Both ranks must run as many chunks (an uneven
    # count left them waiting on each other's gathers until run.actor_timeout_s), and the update
    # is one ZeRO-0 learner's
    from transformers import Qwen2Config

    vocab, lengths = 32_768, [1_400, 40, 30, 20]
    path = tmp_path / "vocab32k"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False, max_position_embeddings=2048,
    )).save_pretrained(path)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (len(lengths), max(lengths)), generator=g)
    ids[:, :5] = ids[0, :5]
    cols = torch.arange(max(lengths))[None, :]
    attention = (cols < torch.tensor(lengths)[:, None]).long()
    response = attention * (cols >= 5)
    batch = TrainBatch(ids, attention, response, torch.ones_like(ids), torch.randn(len(lengths), generator=g))

    def config(learners: int, stage: int, **learner) -> Config:
        raw = layout_config(learners, 4, stage, **learner).model_dump()
        raw["data"]["max_prompt_tokens"], raw["rollout"]["max_new_tokens"] = 5, max(lengths) - 5
        raw["rollout"]["max_model_len"] = max(lengths)
        raw["run"]["actor_timeout_s"] = 90
        return Config.model_validate(raw)

    packed = {"packing": True, "max_tokens_per_micro_batch": max(lengths)}
    reference, rows, tree = updates_after_one_step(
        [config(1, 0, prefix_sharing=False), config(2, 3, **packed, prefix_sharing=False),
         config(2, 3, **packed, prefix_sharing=True)], str(path), batch,
    )  # fmt: skip
    assert relative_difference(rows, reference) < 1e-5
    assert relative_difference(tree, reference) < 1e-5


def test_a_plan_that_skips_counts_each_skipped_sequence_in_the_group_it_would_have_run_in():
    from rltrain.plan import plan_micro_batches, plan_skipping

    # 10 sequences in 2 mini-batches (0-4, 5-9) over 2 ranks, micro-batches of 2; 1, 2, 3 and all of
    # 5-9 but 9 have advantage 0: group 0 runs 0 and 4, group 1 runs 9 alone (rank 1 a blank one)
    skipped = torch.tensor([0, 1, 1, 1, 0, 1, 1, 1, 1, 0]).bool()
    plan = plan_skipping(10, 2, skipped, 2, lambda kept: plan_micro_batches(len(kept), 2, 1, 2))
    assert [[[idx.tolist() for idx in group] for group in rank] for rank in plan.groups] == [
        [[[0]], [[9]]],
        [[[4]], [[]]],
    ]
    assert [idx.tolist() for idx in plan.counted_only] == [[1, 2, 3], [5, 6, 7, 8]]
    every = plan_skipping(4, 1, torch.ones(4, dtype=torch.bool), 2, None)  # nothing to run: blanks
    assert [[[idx.tolist() for idx in group] for group in rank] for rank in every.groups] == [[[[]]], [[[]]]]


def test_models_sharing_served_learners_each_end_with_the_weights_they_get_alone(
    ray_local, tiny_model_path, kept_learners, tmp_path
):
    # Two LoRA models on one set of 2 served learners (the Tinker server's serve.models_per_learners),
    # their calls interleaved so that each model's state is set aside with a gradient its calls added
    # but no step took yet: every model ends with the weights it gets alone on the same learners, under
    # ZeRO-1 (each rank's unreduced gradient set aside as it is) and ZeRO-3 (the reduced gradient set
    # aside and added back at the model's step). Calls of 5 datums split 3 + 2 over the ranks, and of
    # 1 datum (one rank runs a blank micro-batch).
    from rltrain.learner.served import Datums, ServedGroup

    def datums(seed: int, n: int = 5) -> Datums:
        g = torch.Generator().manual_seed(seed)
        tokens = [
            torch.randint(3, 200, (int(k),), generator=g).tolist()
            for k in torch.randint(4, 12, (n,), generator=g)
        ]
        return Datums.of(tokens, [t[1:] + [5] for t in tokens], [{"weights": [1.0] * len(t)} for t in tokens])

    adam = {
        "learning_rate": 1e-2,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-8,
        "weight_decay": 0.01,
        "grad_clip_norm": 1.0,
    }
    calls = {
        "a": [datums(1), datums(2, 1), None, datums(3), None],
        "b": [datums(11), None, datums(12), datums(13, 1), None],
    }
    interleaved = [
        ("a", 0),
        ("b", 0),
        ("a", 1),
        ("b", 1),
        ("b", 2),
        ("a", 2),
        ("b", 3),
        ("a", 3),
        ("b", 4),
        ("a", 4),
    ]

    def run(group: ServedGroup, model: str, call: Datums | None) -> None:
        group.hold(model)
        if call is None:
            group.optim_step(adam)
        else:
            group.forward_backward(call, "cross_entropy", {}, forward_only=False)

    def weights(group: ServedGroup, model: str, folder) -> dict[str, torch.Tensor]:
        folder.mkdir()
        group.hold(model)
        group.save_state(folder)
        return torch.load(folder / "state.pt", weights_only=True)["weights"]

    kept_learners.close()  # (their CPUs back)
    group = None
    try:
        for stage in (1, 3):
            raw = layout_config(2, 8, stage, optimizer="adamw", prefix_sharing=False).model_dump()
            raw["model"]["lora"]["rank"] = 4
            config = Config.model_validate(raw)
            if group is None:
                group = ServedGroup(config, tiny_model_path)
            alone = {}
            for model, model_calls in calls.items():
                group.restart(config, 1)
                for call in model_calls:
                    run(group, model, call)
                alone[model] = weights(group, model, tmp_path / f"{stage}-{model}-alone")
            group.restart(config, 1)
            for model, i in interleaved:
                run(group, model, calls[model][i])
            for model, want in alone.items():
                got = weights(group, model, tmp_path / f"{stage}-{model}")
                assert all(torch.equal(got[n], w) for n, w in want.items()), (stage, model)
            assert any(not torch.equal(alone["a"][n], alone["b"][n]) for n in alone["a"])  # (they differ)
    finally:
        if group is not None:
            group.shutdown()
