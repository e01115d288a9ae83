"""The families people train, exact in every layout (rltrain.models.families, rltrain.learner.attention,
rltrain.loss.forwards): tiny models from transformers configs (tests/families.py), each sequence of a
shared-prompt group alone under the model's own eager attention the reference; padded rows, one
packed row and a prefix tree give its completion log-probs and every parameter's gradient to fp32
rounding. What cannot be made exact (recurrent layers in packed and tree rows) is refused in one
line before anything runs."""

import json

import families
import pytest
import torch

from rltrain.config import ConfigError, load_config
from rltrain.learner import attention
from rltrain.loss.forwards import LogitTransform, output_head
from rltrain.models.families import layout_problem, needs, shares

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
# hybrid models: recurrent layers (Mamba-2, Gated DeltaNet) beside attention (docs/models.md)
HYBRID = {"falcon-h1", "qwen3.5", "qwen3-next"}
# what each family asks of the layouts beyond a causal decoder, as the contract reads it
ASKS = {
    "mistral": {"sliding windows of 6"},
    "qwen2-sliding": {"sliding windows of 6"},
    "gemma2": {"sliding windows of 6", "attention soft-capping", "a logit transform"},
    "gemma3": {"sliding windows of 6", "a logit transform"},
    "gemma4": {"sliding windows of 6", "a logit transform"},
    "gpt-oss": {"sliding windows of 6"},
    "phi3": {"sliding windows of 6"},
    "olmo3": {"sliding windows of 6"},
    "falcon-h1": {"a logit transform", "hybrid layers", "mamba layers"},
    "qwen2.5-vl": {"multi-axis rotary positions"},
    "qwen3.5": {"linear_attention layers"},
    "qwen3-next": {"linear_attention layers"},
}


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_every_family_is_exact_padded_packed_and_as_a_prefix_tree(family):
    gaps = families.worst_differences(family)
    print(family, gaps)
    for layout, (logprob_gap, grad_gap) in gaps.items():
        assert logprob_gap <= 1e-5, (layout, logprob_gap)
        assert family in HYBRID or grad_gap <= 1e-5, (layout, grad_gap)
    if max(grad for _, grad in gaps.values()) > 1e-5:  # (a hybrid's decay parameters in fp32) every
        with families.float64_scans(
            family
        ):  # gradient, with the scans' fp32 rounding lifted (tests/families.py)
            gaps = families.worst_differences(family, dtype=torch.float64)
        print(family, "float64", gaps)
        for layout, (logprob_gap, grad_gap) in gaps.items():
            assert logprob_gap <= 1e-5 and grad_gap <= 1e-5, (layout, logprob_gap, grad_gap)
    model_needs = needs(families.config(family), families.build(family))
    assert set(model_needs.features()) == ASKS.get(family, set())
    assert layout_problem(model_needs, "learner", packing=True, sharing=True) is None and shares(model_needs)
    if family in HYBRID:  # the state would cross ranks
        line = layout_problem(model_needs, "learner", packing=True, sharing="auto", sequence_parallel=2)
        assert "learner.sequence_parallel_size=1" in line and "\n" not in line


def test_recurrent_layers_rltrain_does_not_follow_are_refused_in_packed_rows_in_one_line():
    # a model whose recurrent layers run through functions rltrain does not know (its config names
    # them; its modules define no scan rltrain keeps per sequence) runs padded rows only
    model_needs = needs(families.config("falcon-h1"), families.build("llama"))
    assert model_needs.recurrence_followed is False and not shares(model_needs)
    problem = layout_problem(model_needs, "learner", packing=True, sharing="auto")
    assert "mamba layers" in problem and "learner.packing=false" in problem and "\n" not in problem
    assert layout_problem(model_needs, "learner", packing=False, sharing="auto") is None
    assert "learner.prefix_sharing=false" in layout_problem(
        model_needs, "learner", packing=False, sharing=True
    )


def test_windows_sinks_and_soft_caps_change_what_a_layout_computes():
    # the controls: a window shorter than the prompt, Gemma 2's attention soft-cap and gpt-oss's
    # sinks each change the log-probs (so the matrix above sees a layout that drops one)
    batch = families.group_batch()
    keep, zeros = batch.response_mask.bool(), torch.zeros(batch.input_ids.shape)
    for family, change in [("mistral", {"sliding_window": None}), ("gemma2", {"attn_logit_softcapping": None}),
                           ("gpt-oss", {"layer_types": ["full_attention", "full_attention"]})]:  # fmt: skip
        with_it = families.in_layout(families.build(family, attention.register()), batch, zeros, "tree")[0]
        without = families.in_layout(
            families.build(family, attention.register(), **change), batch, zeros, "tree"
        )[0]
        assert (with_it - without)[keep].abs().max() > 1e-3, family
    sinks = families.build("gpt-oss", attention.register())
    without = families.build("gpt-oss", attention.register())
    with torch.no_grad():
        for name, param in without.named_parameters():
            if name.endswith("sinks"):
                param.fill_(-1e4)  # a sink no query attends to
    with_sinks, without_sinks = (families.in_layout(m, batch, zeros, "packed")[0] for m in (sinks, without))
    assert (with_sinks - without_sinks)[keep].abs().max() > 1e-3


def test_the_head_path_folds_a_familys_logit_transform_in_and_keeps_the_logits_of_one_it_does_not_know():
    # Falcon-H1's multiplier and Gemma's soft-cap run on the hidden-state path (the logits of one
    # chunk at a time); a model whose forward changes its logits in a way no config key says keeps
    # the full-logits path (the probe sees its logits differ from its head's)
    assert output_head(families.build("falcon-h1"))[1].transform == LogitTransform(multiplier=0.5)
    assert output_head(families.build("gemma2"))[1].transform == LogitTransform(softcap=0.1)
    odd = families.build("llama")
    forward = odd.forward

    def scaled(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits = out.logits * 1.5  # (remote code's own logit scale)
        return out

    odd.forward = scaled
    assert output_head(odd) is None


def test_sequence_parallelism_over_a_hybrid_model_is_refused_before_any_actor(tmp_path):
    from rltrain.models.resolve import check_model

    folder = tmp_path / "qwen3.5"
    families.build("qwen3.5").save_pretrained(folder)
    config = load_config("configs/cpu_demo.yaml", [f"model.name_or_path={folder}", "learner.sequence_parallel_size=2",
                                                   "learner.prefix_sharing=false", "rollout.backend=hf"])  # fmt: skip
    with pytest.raises(ConfigError) as refused:
        check_model(config, str(folder))
    line = str(refused.value)
    assert line.startswith("learner:") and "linear_attention layers" in line and "\n" not in line
    check_model(
        load_config("configs/cpu_demo.yaml", [f"model.name_or_path={folder}", "rollout.backend=hf"]),
        str(folder),
    )


def test_a_hybrid_model_on_vllms_cpu_engine_is_refused_in_one_line(tmp_path):
    # vLLM's CPU Gated DeltaNet kernel asserts bf16: an fp32 engine within 1e-4 of the learners is not there
    from rltrain.config import ConfigError, load_config
    from rltrain.models.resolve import check_model
    from rltrain.models.tiny import build_tiny_model

    folder = str(build_tiny_model(tmp_path / "qwen3.5", family="qwen3_5_text"))
    with pytest.raises(ConfigError) as refused:
        check_model(load_config("configs/cpu_demo.yaml", [f"model.name_or_path={folder}"]), folder)
    line = str(refused.value)
    assert line.startswith("rollout.backend=vllm:") and "rollout.backend=hf" in line and "\n" not in line
    check_model(
        load_config("configs/cpu_demo.yaml", [f"model.name_or_path={folder}", "rollout.backend=hf"]), folder
    )


# each family's CLI runs: (model, engine, config, overrides): gpt-oss on the demo's task; Gemma 3 on
# an environment's episodes (configs/cpu_env.yaml: a system turn with the calculator's schema,
# hermes calls, multi-turn trees); the hybrid on the demo's task with the in-process engine; the
# vision-language model on configs/cpu_vision.yaml's pictures (each group's image once in its tree),
# and in builtin:shapes' episodes (after a short warm start on its demonstrations, pictures rendered
# by the processor, a turn that ends gets the picture again, larger: sequences of two images, the
# second in the completion)
CLI_FAMILIES = {
    "gpt-oss": ("builtin:tiny-gpt-oss", "vllm", "configs/cpu_demo.yaml", []),
    "gemma3 episodes": ("builtin:tiny-gemma3", "vllm", "configs/cpu_env.yaml", ["reward.functions={env: 1.0, digits: 1.0}"]),
    "qwen3.5": ("builtin:tiny-qwen3.5", "hf", "configs/cpu_demo.yaml", []),
    "vision": ("builtin:tiny-vl", "vllm", "configs/cpu_vision.yaml", []),
    "vision episodes": ("builtin:tiny-vl", "vllm", "configs/cpu_vision.yaml", ["env.name=builtin:shapes", "sft_warmup.steps=40", "sft_warmup.source=env",
                        "reward.functions={env: 1.0, digits: 1.0}", "run.save_rollouts_every=1"]),
}  # fmt: skip


def train(config: str, out, *overrides: str, env: dict) -> list[dict]:
    import os
    import subprocess
    import sys

    from test_e2e import REPO, SMALL

    done = subprocess.run([sys.executable, "-m", "rltrain.train", "--config", config, *SMALL, f"run.output_dir={out}",
                           *overrides], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **env})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("family", CLI_FAMILIES)
def test_a_family_trains_through_the_cli_exactly_with_packing_and_sharing(family, tmp_path, ray_cluster):
    # gpt-oss (a window of 8, sinks, 4 experts) and Gemma 3 (sliding and full layers, the logit
    # soft-cap) with vLLM, Qwen3.5's hybrid (Gated DeltaNet beside attention) with the in-process
    # engine, on the built-in tokenizer, completions of up to 24 tokens (longer than the windows):
    # 2 learners, ZeRO-2, packing and prefix sharing on. The engine's log-probs equal the learners'
    # at every step, and with plain SGD the first update is one learner's, each sequence padded in
    # one micro-batch under transformers' own attention, unshared
    from transformers import AutoConfig

    from rltrain.config import BUILTIN_MODELS
    from rltrain.models.families import causal_lm_class
    from rltrain.run.diagnostics import relative_difference

    def weights(folder):
        return causal_lm_class(AutoConfig.from_pretrained(folder)).from_pretrained(folder).state_dict()

    model, backend, config, more = CLI_FAMILIES[family]
    sgd = [f"model.name_or_path={model}", f"rollout.backend={backend}", "learner.optimizer=sgd", "learner.lr=0.5",
           "learner.max_grad_norm=0", "learner.warmup_steps=0", "rollout.max_new_tokens=24",
           "run.checkpoint_every=1", *more]  # fmt: skip
    out, one = tmp_path / "run", tmp_path / "one"
    rows = train(config, out, *sgd, "run.steps=3", "learner.prefix_sharing=true", env=ray_cluster)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["rollout/mismatch_max"] <= 1e-4, row
        assert row["perf/prefix_shared_fraction"] > 0.3  # each group's prompt computed once
    (unshared,) = train(config, one, *sgd, "run.steps=1", "learner.num_learners=1", "learner.zero_stage=0",
                        "learner.packing=false", "learner.micro_batch_size=16", "learner.prefix_sharing=false",
                        env=ray_cluster)  # fmt: skip
    assert unshared["perf/tokens_forwarded"] == unshared["perf/forward_tokens"]  # nothing shared there
    start = weights(out / f"tiny_{BUILTIN_MODELS[model]}_model")
    step_1 = weights(out / "checkpoints" / "step_1" / "hf")
    update = {k: step_1[k] - start[k] for k in start}
    reference = {k: v - start[k] for k, v in weights(one / "final_model").items()}
    assert relative_difference(update, reference) < 1e-5
    if family == "vision":  # the exported model is whole (its processor too) and its tower as it began
        from transformers import AutoProcessor

        from rltrain.models.images import is_vision_parameter

        assert AutoProcessor.from_pretrained(out / "final_model").image_token == "<|image_pad|>"
        assert all(update[k].abs().max() == 0 for k in update if is_vision_parameter(k))
    if family == "vision episodes":  # some episode was shown its picture again, in its completion
        lines = (out / "rollouts" / "step_1.jsonl").read_text().splitlines()
        shown = [[p for m in json.loads(line)["messages"] if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"] for line in lines]  # fmt: skip
        assert max(len(s) for s in shown) == 2, shown
    if family == "gemma3 episodes":  # the system turn with the tool's schema and the question: most of it
        assert rows[0]["perf/prefix_shared_fraction"] > 0.5
        assert rows[0]["perf/tokens_forwarded"] < 0.5 * rows[0]["perf/forward_tokens"]


@pytest.mark.slow
def test_a_hybrid_models_token_mode_update_is_the_same_in_every_layout_and_the_naive_mean_is_not(
    ray_local, tmp_path
):
    # builtin:tiny-qwen3.5 (a Gated DeltaNet layer beside a full-attention one) through real learners
    # and DeepSpeed: 8 sequences of 4-14 tokens in groups of 4 sharing a prompt. One learner, every
    # sequence padded in one micro-batch, unshared, is the reference; 2 learners packed with prefix
    # trees under ZeRO-2 (one micro-batch each) and ZeRO-3 (a budget of 16 tokens: several
    # micro-batches, accumulation) give its update. The per-micro-batch mean over 2 x (3 + 1) padded
    # micro-batches does not (with one micro-batch on one learner it is the token mean: the reference)
    from rltrain.models.tiny import build_tiny_model
    from rltrain.run.diagnostics import (
        layout_config,
        relative_difference,
        synthetic_rollouts,
        updates_after_one_step,
    )

    path = str(build_tiny_model(tmp_path / "qwen3.5", family="qwen3_5_text"))
    batch = synthetic_rollouts(group_size=4)
    layouts = {
        "ZeRO-2 packed, trees": layout_config(2, 1, 2, max_tokens_per_micro_batch=200, prefix_sharing=True),
        "ZeRO-3 packed in 16 tokens, trees": layout_config(
            2, 1, 3, max_tokens_per_micro_batch=16, prefix_sharing=True
        ),
    }
    reference, *updates, naive = updates_after_one_step(
        [layout_config(1, 8, 0, prefix_sharing=False), *layouts.values(),
         layout_config(2, 3, 0, None, prefix_sharing=False)], path, batch,
    )  # fmt: skip
    diffs = {name: relative_difference(update, reference) for name, update in zip(layouts, updates)}
    print(
        f"hybrid token-mode update differences {diffs}; per-micro-batch 2x(3+1) {relative_difference(naive, reference):.3e}"
    )
    assert max(diffs.values()) < 1e-5, diffs
    assert relative_difference(naive, reference) > 1e-2
    moved = [k for k, v in reference.items() if "linear_attn" in k and v.abs().max() > 0]
    assert any(k.endswith("in_proj_qkv.weight") for k in moved) and any("conv1d" in k for k in moved)
