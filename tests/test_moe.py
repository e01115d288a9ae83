"""A mixture of experts (builtin:tiny-moe) on real Ray + DeepSpeed learners and through the CLI: the
load-balancing loss exact over the optimizer step under every layout, its logged value against
transformers' own function, and the weight sync into vLLM exact at every step."""

import json
import os
import subprocess
import sys

import pytest
import torch
from test_e2e import REPO, SMALL, final_weights
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rltrain.diagnostics import (
    layout_config,
    metrics_of_one_step,
    relative_difference,
    synthetic_rollouts,
    updates_after_one_step,
)
from rltrain.forward import padded_forward
from rltrain.models.tiny import MOE_EXPERTS, MOE_TOP_K, build_tiny_model

pytestmark = pytest.mark.slow
COEF = 0.5  # large beside the policy loss, so a wrong aux gradient shows in the whole update


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "model", family="qwen3_moe"))


def moe_config(*args, scope: str = "step", **kwargs):
    return layout_config(*args, loss={"moe_aux_coef": COEF, "moe_aux_scope": scope}, **kwargs)


def routers(update: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in update.items() if k.endswith("mlp.gate.weight")}


def test_load_balancing_loss_is_exact_over_the_step_under_every_layout(ray_local, kept_learners, moe_path):
    # the reference: one learner, all 8 sequences in one padded micro-batch (one forward: there the
    # step's loss and transformers' per-forward loss are the same). Every split of the same batch
    # over ranks x micro-batches x ZeRO stage, packed rows and sequence parallelism gives its update
    # at step scope; micro_batch scope (transformers' loss per forward, averaged) does not
    # Groups of 4 share a prompt: the reference computes each sequence in its own row, the layouts
    # (but sequence parallelism's) each micro-batch's shared prompt once (learner.prefix_sharing)
    batch = synthetic_rollouts(group_size=4)
    layouts = {
        "ZeRO-0 2x2": moe_config(2, 2, 0, prefix_sharing=True),
        "ZeRO-2 2x3+1": moe_config(2, 3, 2, prefix_sharing=True),
        "ZeRO-3 2x3+1": moe_config(2, 3, 3, prefix_sharing=True),
        "ZeRO-2 packed, budget 16": moe_config(2, 1, 2, max_tokens_per_micro_batch=16, prefix_sharing=True),
        "ZeRO-3 sp2 packed, budget 30": moe_config(2, 1, 3, max_tokens_per_micro_batch=30, sequence_parallel_size=2),
    }  # fmt: skip
    controls = [
        moe_config(1, 8, 0, scope="micro_batch", prefix_sharing=False),
        moe_config(2, 3, 2, scope="micro_batch"),
    ]
    reference, *updates, one_forward, split = updates_after_one_step(
        [moe_config(1, 8, 0, prefix_sharing=False), *layouts.values(), *controls], moe_path, batch
    )
    diffs = {name: relative_difference(u, reference) for name, u in zip(layouts, updates)}
    router_diffs = {
        name: relative_difference(routers(u), routers(reference)) for name, u in zip(layouts, updates)
    }
    naive = relative_difference(routers(split), routers(one_forward))
    print(f"step scope vs one forward: {diffs}, routers {router_diffs}; micro_batch scope 2x3+1: {naive:.3e}")
    assert max(diffs.values()) < 1e-5 and max(router_diffs.values()) < 1e-5, (diffs, router_diffs)
    assert relative_difference(one_forward, reference) == 0.0  # one forward: the scopes agree
    assert naive > 1e-2, naive


def test_logged_load_balancing_loss_and_expert_load_are_transformers_on_the_whole_step(
    ray_local, kept_learners, moe_path
):
    # 2 learners x micro-batches of 3 (one padding micro-batch): the logged moe/aux_loss is
    # transformers' load_balancing_loss_func on all 8 sequences at once (padding excluded), and
    # moe/expert_load_max is the busiest expert's share of each layer's top-2 assignments over 1/8
    batch = synthetic_rollouts()
    metrics = metrics_of_one_step(moe_config(2, 3, 2), moe_path, batch)
    model = AutoModelForCausalLM.from_pretrained(moe_path)
    logits = []  # each layer's router logits [8 * 14, experts], in order
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda m, a, o: logits.append(o[0]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        padded_forward(model, batch.input_ids, batch.attention_mask)
    for hook in hooks:
        hook.remove()
    expected = load_balancing_loss_func(tuple(logits), MOE_EXPERTS, MOE_TOP_K, batch.attention_mask)
    assert metrics["moe/aux_loss"] == pytest.approx(expected.item(), rel=1e-5)
    keep = batch.attention_mask.reshape(-1).bool()
    loads = []
    for layer_logits in logits:
        counts = torch.bincount(layer_logits[keep].topk(MOE_TOP_K).indices.reshape(-1), minlength=MOE_EXPERTS)
        loads.append((counts.max() / (counts.sum() / MOE_EXPERTS)).item())
    assert metrics["moe/expert_load_max"] == pytest.approx(max(loads), rel=1e-6)
    assert [metrics[f"moe/expert_load_max/layer_{i}"] for i in range(len(loads))] == pytest.approx(loads)
    assert 0 < metrics["moe/router_entropy"] <= torch.log(torch.tensor(float(MOE_EXPERTS))).item()


def run_moe(out, *overrides: str, env: dict) -> list[dict]:
    done = subprocess.run(
        [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_moe.yaml", *SMALL,
         f"run.output_dir={out}", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_moe_run_through_the_cli_syncs_exactly_and_its_update_is_the_layout_s_choice_only(
    tmp_path, ray_cluster
):
    # cpu_moe.yaml (2 learners, ZeRO-2, vLLM) for 2 steps: the engine's log-probs equal the
    # learners' after every sync (the run's own check, on by default, stops a run where they do
    # not; the CPU experts need their weights re-laid after a reload), and every step logs the
    # routers. With plain SGD its first update equals that of one learner in one micro-batch (that
    # micro_batch scope differs in such a layout: test_load_balancing_loss_is_exact_over_the_step_under_every_layout)
    sgd = ["learner.optimizer=sgd", "learner.lr=0.5", "learner.max_grad_norm=0", "learner.warmup_steps=0",
           "learner.micro_batch_size=3", "run.checkpoint_every=1"]  # fmt: skip
    rows = run_moe(tmp_path / "run", *sgd, "run.steps=2", "learner.prefix_sharing=true", env=ray_cluster)
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["sync/probe_gap"] < 1e-3  # the first sync's check (a reload left as it was: 0.056)
    for row in rows:  # step 2 samples from the synced weights
        assert row["rollout/mismatch_max"] < 1e-3, row
        assert row["moe/aux_loss"] > 0 and row["moe/expert_load_max"] >= 1.0 and row["moe/router_entropy"] > 0
    assert rows[0]["perf/prefix_shared_fraction"] > 0.3  # each group's prompt computed once
    # the reference run (each sequence in its own row) replays vLLM's routes (recorded by its routers' hooks, through the tool
    # loop, in the learner's forward): the engine and the learner route alike here (fp32, the same
    # weights), so replay changes nothing, while a route landing on another token would show as a
    # mismatch and a different update
    one = tmp_path / "one"
    (replayed,) = run_moe(one, *sgd, "run.steps=1", "learner.num_learners=1", "learner.zero_stage=0",
                          "learner.micro_batch_size=16", "rollout.routing_replay=true", "learner.prefix_sharing=false",
                          env=ray_cluster)  # fmt: skip
    assert replayed["moe/routing_mismatch"] == 0.0 and replayed["rollout/mismatch_max"] < 1e-3
    assert 0.9 < replayed["moe/routes_replayed"] < 1.0  # all but each sequence's last token
    # 16 sequences x (prompt + completion) positions x 2 layers x top-2, one byte each
    assert replayed["perf/routes_bytes"] >= 16 * 2 * 2 * 10
    step_1 = AutoModelForCausalLM.from_pretrained(
        tmp_path / "run" / "checkpoints" / "step_1" / "hf"
    ).state_dict()
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "tiny_moe_model").state_dict()
    update = {k: step_1[k] - start[k] for k in start}
    reference = {k: v - start[k] for k, v in final_weights(one).items()}
    assert relative_difference(update, reference) < 1e-5
    assert any(v.abs().max() > 0 for v in routers(update).values())  # the routers moved


# each kind of router output (rltrain.models.routers), on a tiny model of a family that has it, and
# what its layers ask of the layout: (model type, engine, overrides)
ROUTER_KINDS = {
    "top-k, sigmoid past a score-correction bias (GLM-4.5)": ("glm4_moe", "vllm", []),
    "top-k, experts first (Granite)": ("granitemoe", "hf", []),
    "dense scores (Llama 4; chunked attention: padded rows)": ("llama4_text", "hf", ["learner.packing=false"]),
    "sorted, two routers a layer (JetMoE)": ("jetmoe", "hf", []),
    "logits alone (Jamba; Mamba layers: padded rows)": ("jamba", "hf", ["learner.packing=false", "rollout.routing_replay=false"]),
}  # fmt: skip


@pytest.mark.parametrize("kind", ROUTER_KINDS)
def test_each_kind_of_router_trains_through_the_cli_with_the_load_balancing_loss_and_replay(
    kind, tmp_path, ray_cluster
):
    # one step of cpu_moe.yaml on 2 learners (ZeRO-2, micro-batches of 3: accumulation) with the
    # loss at step scope and the engine's routes replayed: the run's own checks hold (the engine
    # against the learners before any work, the first step's gap, the first sync's probe), every
    # replayed route is the learner router's own choice (fp32 on both sides), and the routers are
    # read (their loss, load and entropy logged); the exactness of such a step's update over
    # layouts: test_a_kind_of_routers_update_is_the_same_in_every_layout below
    import families

    model_type, backend, more = ROUTER_KINDS[kind]
    folder = families.save_moe(model_type, tmp_path / model_type)
    (row,) = run_moe(tmp_path / "run", f"model.name_or_path={folder}", f"rollout.backend={backend}", "run.steps=1",
                     "learner.micro_batch_size=3", "loss.moe_aux_coef=0.5", "rollout.routing_replay=true",
                     "rollout.max_new_tokens=12", *more, env=ray_cluster)  # fmt: skip
    assert row["sync/startup_gap"] < 1e-4 and row["rollout/mismatch_max"] < 1e-3, row
    assert row["moe/aux_loss"] > 0 and row["moe/expert_load_max"] >= 1.0 and row["moe/router_entropy"] > 0
    if "rollout.routing_replay=false" not in more:
        assert row["moe/routing_mismatch"] == 0.0 and 0.9 < row["moe/routes_replayed"] <= 1.0, row


@pytest.mark.parametrize("model_type", ["glm4_moe", "granitemoe", "llama4_text", "jetmoe"])
def test_a_kind_of_routers_update_is_the_same_in_every_layout_and_the_per_forward_loss_is_not(
    model_type, ray_local, kept_learners, tmp_path
):
    # the load-balancing loss read from each kind of router, at step scope: one learner with all 8
    # sequences in one padded micro-batch (the reference, where the step's loss is transformers'
    # per-forward loss) and 2 learners x micro-batches of 3 under ZeRO-2 (packed where the family's
    # contract allows) give the same update; micro_batch scope in that layout does not
    import families

    folder = str(families.save_moe(model_type, tmp_path / model_type))
    packed = model_type != "llama4_text"  # (chunked attention: padded rows)
    batch = synthetic_rollouts(group_size=4, vocab=200)
    reference, split, naive = updates_after_one_step(
        [moe_config(1, 8, 0, prefix_sharing=False), moe_config(2, 3, 2, packing=packed),
         moe_config(2, 3, 2, scope="micro_batch", packing=packed)], folder, batch)  # fmt: skip
    gap, control = relative_difference(split, reference), relative_difference(naive, reference)
    print(f"{model_type}: step scope {gap:.2e}, micro_batch scope {control:.2e}")
    assert gap < 1e-5 and control > 1e-3, (gap, control)


def test_router_biases_travel_with_every_sync_and_a_sync_that_leaves_one_behind_is_named(ray_local, tmp_path):
    # GLM-4.5's routers choose past a score-correction bias, a buffer (no optimizer moves it, so a
    # sync of named_parameters() alone left it behind: the engine kept the one it loaded). Shifted on
    # the learners, it reaches vLLM over the weight group and the transformers engine through the
    # object store, and their log-probs follow; vLLM's own account of a reload names one left out
    import families
    import ray

    from rltrain.config import Config
    from rltrain.learner.group import LearnerGroup
    from rltrain.rollout import GeneratorPool
    from rltrain.run.weight_sync import CollectiveSync, ObjectStoreSync, check_sync

    folder = str(families.save_moe("glm4_moe", tmp_path / "glm4_moe"))
    config = {"learner": {"num_learners": 1, "zero_stage": 0}}
    learners = LearnerGroup(Config.model_validate(config), folder, total_optimizer_steps=1)
    engines = {b: GeneratorPool(Config.model_validate({**config, "rollout": {"backend": b}}), folder)
               for b in ("vllm", "hf")}  # fmt: skip
    probe = synthetic_rollouts(n=4, vocab=200)
    sequences = [ids[mask.bool()].tolist() for ids, mask in zip(probe.input_ids, probe.attention_mask)]

    def shift_biases(learner):
        for name, buffer in learner.engine.module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.linspace(-2.0, 2.0, buffer.numel()))  # a different choice of experts

    try:
        before = {b: pool.prompt_logprobs(sequences) for b, pool in engines.items()}
        ray.get([actor.__ray_call__.remote(shift_biases) for actor in learners.actors])
        state = learners.state_dict()
        assert any(name.endswith("mlp.gate.e_score_correction_bias") for name in state)  # what a sync sends
        gaps, moved = {}, {}
        for backend, pool in engines.items():
            sync = (
                CollectiveSync(learners, pool, False, pool_rollout(backend))
                if backend == "vllm"
                else ObjectStoreSync()
            )
            sync.push(learners, pool, 1)
            gaps[backend] = check_sync(learners, pool, probe, 0.0, 1)
            after = pool.prompt_logprobs(sequences)
            moved[backend] = max(
                (torch.tensor(a) - torch.tensor(b)).abs().max().item() for a, b in zip(after, before[backend])
            )
            assert pool.weights_not_loaded() == [], backend
        left = {k: v for k, v in state.items() if not k.endswith("e_score_correction_bias")}
        engines["vllm"].load_weights(ray.put(left), 2)
        missing = engines["vllm"].weights_not_loaded()
    finally:
        learners.shutdown()
        for pool in engines.values():
            pool.shutdown()
    print(
        f"after the sync: engine - learner {gaps}; engines' log-probs moved by {moved}; left out: {missing}"
    )
    assert max(gaps.values()) < 1e-4 and min(moved.values()) > 1e-3
    assert missing and all("e_score_correction_bias" in name for name in missing)


def pool_rollout(backend: str):
    from rltrain.config import Config

    return Config.model_validate({"rollout": {"backend": backend}}).rollout
