"""The families people train, exact in every layout (rltrain.models.families, rltrain.learner.attention,
rltrain.forward): tiny models from transformers configs (tests/families.py), each sequence of a
shared-prompt group alone under the model's own eager attention the reference; padded rows, one
packed row and a prefix tree give its completion log-probs and every parameter's gradient to fp32
rounding. What cannot be made exact (recurrent layers in packed and tree rows) is refused in one
line before anything runs."""

import json

import families
import pytest
import torch

from rltrain.config import ConfigError, load_config
from rltrain.forward import attention
from rltrain.forward.head import LogitTransform, output_head
from rltrain.models.families import layout_problem, needs, shares

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
# hybrid models: recurrent layers (Mamba-2, Gated DeltaNet, a short convolution) beside attention
# (docs/models.md), their state kept per sequence in packed and tree rows
HYBRID = {"falcon-h1", "qwen3.5", "qwen3-next", "granite4-hybrid", "lfm2"}
# families whose packed and tree rows rltrain cannot make exact: refused there in one line (the true
# reason named), exact in padded rows
PADDED_ONLY = {
    "recurrentgemma": "recurrent layers (RecurrentGemmaRecurrentBlock: a state carried in code of its own",
    "bloom": "attention that does not go through transformers' attention functions",
    "jamba": "linear_attention layers (mamba_selective_scan: a state rltrain does not keep per sequence)",
    "kimi-linear": "linear_attention layers (chunk_kimi_delta_attention: a state rltrain does not keep",
}
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
    "falcon-h1": {"a logit transform", "hybrid layers"},
    "qwen2.5-vl": {"multi-axis rotary positions"},
    "qwen3.5": {"linear_attention layers"},
    "qwen3-next": {"linear_attention layers"},
    "ministral3": {"sliding windows of 6"},
    "granite4-hybrid": {"linear_attention layers"},
    "recurrentgemma": {"sliding windows of 6", "a logit transform", "recurrent layers"},
    "bloom": {"attention of its own", "ALiBi position biases"},
    "lfm2": {"conv layers"},
    "jamba": {"linear_attention layers"},
    "kimi-linear": {"linear_attention layers"},
}


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_every_family_is_exact_padded_packed_and_as_a_prefix_tree_or_refused_there(family):
    model_needs = needs(families.config(family), families.build(family))
    assert set(model_needs.features()) == ASKS.get(family, set())
    if family in PADDED_ONLY:  # padded rows exact; packed and tree rows refused with the true reason,
        (logprob_gap, grad_gap) = families.worst_differences(family, layouts=("padded",))["padded"]
        assert logprob_gap <= 1e-5 and grad_gap <= 1e-5, (logprob_gap, grad_gap)
        line = layout_problem(model_needs, "learner", packing=True, sharing="auto")
        assert PADDED_ONLY[family] in line and "learner.packing=false" in line and "\n" not in line
        assert not shares(model_needs) and layout_problem(model_needs, "learner", False, "auto") is None
        assert "learner.prefix_sharing=false" in layout_problem(model_needs, "learner", False, True)
        under_sp = layout_problem(model_needs, "learner", packing=True, sharing="auto", sequence_parallel=2)
        assert (
            "learner.sequence_parallel_size=1 and learner.packing=false" in under_sp
        )  # (advice the config takes)
        # ... which they need: run anyway, packed and tree rows are off
        gaps = families.worst_differences(family, layouts=("packed", "tree"))
        assert max(gap for gap, _ in gaps.values()) > 1e-5, gaps
        return
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
    assert layout_problem(model_needs, "learner", packing=True, sharing=True) is None and shares(model_needs)
    if family in HYBRID:  # the state would cross ranks
        line = layout_problem(model_needs, "learner", packing=True, sharing="auto", sequence_parallel=2)
        assert "learner.sequence_parallel_size=1" in line and "\n" not in line


def test_each_kind_of_layer_is_read_for_what_it_is():
    # Nemotron-H-style kinds (mlp, moe) carry nothing; a kind rltrain does not know is refused in
    # packed rows as such; a model that mixes a followed kind (Gated DeltaNet) with an unfollowed
    # one (Mamba-1's selective scan in the same layer list) is refused for that kind alone, where
    # reading "followed" for the whole model would have packed the Mamba-1 state across documents
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    from rltrain.models.families import _read_layers

    qwen = families.build("qwen3.5")
    unfollowed, own, called = _read_layers(qwen, ("linear_attention", "full_attention", "linear_attention"))
    assert unfollowed == {} and own == () and "torch_chunk_gated_delta_rule" in called
    unfollowed, own, _ = _read_layers(qwen, ("mlp", "moe", "chunked_attention"))
    assert unfollowed == {"chunked_attention": "a kind of layer rltrain does not know"}
    assert own == ("chunked_attention",)
    jamba = families.config("jamba")
    qwen.model.layers[2].linear_attn = JambaMambaMixer(jamba, layer_idx=0)  # (a third kind of layer)
    unfollowed, _, _ = _read_layers(qwen, ("linear_attention", "full_attention", "mamba"))
    assert set(unfollowed) == {"mamba"} and "mamba_selective_scan" in unfollowed["mamba"]


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
    on_vllm = load_config("configs/cpu_demo.yaml", [f"model.name_or_path={folder}"])
    if torch.cuda.is_available():  # (vLLM on a GPU serves them: nothing to refuse there)
        check_model(on_vllm, folder)
    else:
        with pytest.raises(ConfigError) as refused:
            check_model(on_vllm, folder)
        line = str(refused.value)
        assert line.startswith("rollout.backend=vllm:") and "rollout.backend=hf" in line and "\n" not in line
    check_model(
        load_config("configs/cpu_demo.yaml", [f"model.name_or_path={folder}", "rollout.backend=hf"]), folder
    )


# each family's CLI runs: (model, engine, config, overrides): gpt-oss on the demo's task; Gemma 3 on
# an environment's episodes (configs/cpu_env.yaml: a system turn with the calculator's schema,
# hermes calls, multi-turn trees); the hybrid on the demo's task with the in-process engine; the
# vision-language model on configs/cpu_vision.yaml's pictures in builtin:shapes' episodes (each
# group's image once in its tree, under ZeRO-3 with every collective checked across the ranks; after
# a short warm start on its demonstrations, pictures rendered by the processor, a turn that ends gets
# the picture again, larger: sequences of two images, the second in the completion; a tree on one
# rank and a lone sequence on the other: tests/test_uneven_ranks.py)
CLI_FAMILIES = {
    "gpt-oss": ("builtin:tiny-gpt-oss", "vllm", "configs/cpu_demo.yaml", []),
    "gemma3 episodes": ("builtin:tiny-gemma3", "vllm", "configs/cpu_env.yaml", ["reward.functions={env: 1.0, digits: 1.0}"]),
    "qwen3.5": ("builtin:tiny-qwen3.5", "hf", "configs/cpu_demo.yaml", []),
    "vision episodes": ("builtin:tiny-vl", "vllm", "configs/cpu_vision.yaml", ["env.name=builtin:shapes", "sft_warmup.steps=40", "sft_warmup.source=env",
                        "reward.functions={env: 1.0, digits: 1.0}", "run.save_rollouts_every=1", "learner.zero_stage=3",
                        "run.check_collectives=true"]),
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
    from rltrain.diagnostics import relative_difference
    from rltrain.models.families import causal_lm_class

    def weights(folder):
        return causal_lm_class(AutoConfig.from_pretrained(folder)).from_pretrained(folder).state_dict()

    model, backend, config, more = CLI_FAMILIES[family]
    sgd = [f"model.name_or_path={model}", f"rollout.backend={backend}", "learner.optimizer=sgd", "learner.lr=0.5",
           "learner.max_grad_norm=0", "learner.warmup_steps=0", "rollout.max_new_tokens=24",
           "run.checkpoint_every=1", *more]  # fmt: skip
    out, one = tmp_path / "run", tmp_path / "one"
    rows = train(config, out, *sgd, "run.steps=2", "learner.prefix_sharing=true", env=ray_cluster)
    assert [r["step"] for r in rows] == [1, 2]  # (step 2's gap: the engine on the synced update)
    for row in rows:
        assert row["rollout/mismatch_max"] <= 1e-4, row
        assert row["perf/prefix_shared_fraction"] > 0.3  # each group's prompt computed once
    # the reference starts where the run's RL began: from its warmed-up model where it has one
    initial, warmed = out / f"tiny_{BUILTIN_MODELS[model]}_model", out / "sft_model"
    begins = [f"model.name_or_path={warmed}", "sft_warmup.steps=0"] if warmed.exists() else []
    (unshared,) = train(config, one, *sgd, "run.steps=1", "learner.num_learners=1", "learner.zero_stage=0",
                        "learner.packing=false", "learner.micro_batch_size=16", "learner.prefix_sharing=false",
                        *begins, env=ray_cluster)  # fmt: skip
    assert unshared["perf/tokens_forwarded"] == unshared["perf/forward_tokens"]  # nothing shared there
    start = weights(warmed if begins else initial)
    step_1 = weights(out / "checkpoints" / "step_1" / "hf")
    update = {k: step_1[k] - start[k] for k in start}
    reference = {k: v - start[k] for k, v in weights(one / "final_model").items()}
    assert relative_difference(update, reference) < 1e-5
    if (
        family == "vision episodes"
    ):  # the exported model is whole (its processor too) and its tower as it began
        from transformers import AutoProcessor

        from rltrain.models.images import is_vision_parameter

        assert AutoProcessor.from_pretrained(out / "final_model").image_token == "<|image_pad|>"
        first = weights(initial)  # (through the warm-up and RL)
        assert all((step_1[k] - first[k]).abs().max() == 0 for k in first if is_vision_parameter(k))
        # some episode was shown its picture again, in its completion
        lines = (out / "rollouts" / "step_1.jsonl").read_text().splitlines()
        shown = [[p for m in json.loads(line)["messages"] if isinstance(m["content"], list) for p in m["content"]
                  if p["type"] == "image"] for line in lines]  # fmt: skip
        assert max(len(s) for s in shown) == 2, shown
    if family == "gemma3 episodes":  # the system turn with the tool's schema and the question: most of it
        assert rows[0]["perf/prefix_shared_fraction"] > 0.5
        assert rows[0]["perf/tokens_forwarded"] < 0.5 * rows[0]["perf/forward_tokens"]


@pytest.mark.slow
def test_a_hybrid_models_token_mode_update_is_the_same_in_every_layout_and_the_naive_mean_is_not(
    ray_local, kept_learners, tmp_path
):
    # builtin:tiny-qwen3.5 (a Gated DeltaNet layer beside a full-attention one) through real learners
    # and DeepSpeed: 8 sequences of 4-14 tokens in groups of 4 sharing a prompt. One learner, every
    # sequence padded in one micro-batch, unshared, is the reference; 2 learners packed with prefix
    # trees under ZeRO-2 (one micro-batch each) and ZeRO-3 (a budget of 16 tokens: several
    # micro-batches, accumulation) give its update. The per-micro-batch mean over 2 x (3 + 1) padded
    # micro-batches does not (with one micro-batch on one learner it is the token mean: the reference)
    from rltrain.diagnostics import (
        layout_config,
        relative_difference,
        synthetic_rollouts,
        updates_after_one_step,
    )
    from rltrain.models.tiny import build_tiny_model

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


def test_the_packed_convolution_is_each_sequences_own_on_a_tree_with_short_branches():
    # a tree row: a 6-token prompt, a branch of 1 token, one of 2 continued by a branch of 1, one of
    # 5, then a document of 3 (shorter than the kernel's reach): each token's output is the causal
    # convolution of its own sequence alone (zeros before its start), values and gradients
    from rltrain.forward.recurrent import convolve
    from rltrain.forward.structure import Row

    positions = torch.tensor([0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 6, 7, 8, 9, 10, 0, 1, 2])
    sequences = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 7, 8], [0, 1, 2, 3, 4, 5, 7, 8, 9],
                 [0, 1, 2, 3, 4, 5, 10, 11, 12, 13, 14], [15, 16, 17]]  # fmt: skip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, len(positions), generator=g, requires_grad=True)
    weight, bias = torch.randn(3, 4, generator=g, requires_grad=True), torch.randn(3, generator=g)
    out = convolve(Row(positions), x, weight, bias, "silu")
    for seq in sequences:
        alone = torch.nn.functional.conv1d(x[:, :, seq], weight[:, None], bias, padding=3, groups=3)[
            ..., : len(seq)
        ]
        torch.testing.assert_close(out[:, :, seq], torch.nn.functional.silu(alone))
    # each token's output is its own sequence's: the gradient of one output reaches its inputs alone
    out[0, :, 14].sum().backward()
    reached = (x.grad[0].abs().sum(0) > 0).nonzero().flatten().tolist()
    assert reached == [11, 12, 13, 14]  # the last 4 of [.., 5, 10, 11, 12, 13, 14]: a kernel of 4


def test_the_packed_convolution_keeps_no_more_for_its_backward_than_the_padded_one():
    # linear memory: what autograd saves for the backward is the size of the input (and the few
    # crossing windows), never kernel times it (a [C, L, K] gather of every token's window);
    # benchmarks/bench_hybrid_conv.py prints the peak memory and time against the padded forward
    from rltrain.forward.recurrent import convolve
    from rltrain.forward.structure import Row

    positions = torch.cat([torch.arange(300)] * 4)  # 4 documents of 300 tokens
    x = torch.randn(1, 8, len(positions), requires_grad=True)
    weight = torch.randn(8, 4, requires_grad=True)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        convolve(Row(positions), x, weight, None, "silu")
    assert max(saved) <= x.numel() + 8, saved  # (the conv's padded input: 3 columns more)


def test_each_model_reads_the_row_its_own_forward_announced_when_two_run_in_one_process():
    # the row a forward runs is its model's, not the process's: model A's packed row (two documents)
    # announced, model B of the same hybrid family runs padded rows in between, and A's forward
    # still follows its own row (each document's recurrent state its own: A's packed forward alone,
    # bit for bit). With one row for the process, B's padded forward announced "rows of their own"
    # over A's, and A's Gated DeltaNet scan ran across its documents (the control below)
    from rltrain.forward import packed_forward, padded_forward, recurrent

    first, second = (
        families.build("qwen3.5", attention.register()),
        families.build("qwen3.5", attention.register(), 1),
    )
    ids = torch.randint(3, families.VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(6), torch.arange(5)])[None]  # documents of 6 and 5 tokens

    def run_first():  # A's forward of the row, as packed_forward runs it after announcing it
        return first(input_ids=ids, position_ids=positions, attention_mask=None, use_cache=False).logits

    with torch.no_grad():
        alone = packed_forward(first, ids, positions).logits
        recurrent.expect(first, positions)
        padded_forward(second, ids[:, :7], torch.ones(1, 7, dtype=torch.long))
        torch.testing.assert_close(run_first(), alone, rtol=0, atol=0)
        recurrent.expect(first, None)  # the control: the same row read as one sequence differs
        assert (run_first()[0, 6:] - alone[0, 6:]).abs().max() > 1e-3


def test_a_first_step_engine_learner_gap_past_rounding_in_fp32_stops_the_run_naming_the_layout():
    # the safety net for families nobody lists: the engine and the learners hold the same weights at
    # the first step, and in fp32 an exact layout reads under 1e-5 (tiny models) to 1.4e-4 (a 30-layer
    # 135M model); Bloom's packed rows read 7.1e-3 through the CLI, and the run trained on
    from rltrain.run.loop import RunFailed, check_first_gap

    packed = load_config("configs/cpu_demo.yaml", ["learner.packing=true"])
    check_first_gap(packed, 1, {"rollout/mismatch_max": 1.4e-4})  # rounding: goes on
    with pytest.raises(RunFailed) as stopped:
        check_first_gap(packed, 1, {"rollout/mismatch_max": 7.1e-3, "perf/prefix_shared_fraction": 0.4})
    line = str(stopped.value)
    assert line.startswith("step 1: the engine's log-probs differ from the learners' by 0.0071")
    assert "packed rows (learner.packing=true) and prefix trees" in line and "\n" not in line
    assert "set learner.packing=false learner.prefix_sharing=false (padded rows)" in line
    # not where one side runs bf16 (a GPU engine), for a mixture of experts (a near-tie routes apart),
    # or with the check off
    for config, metrics in [(load_config("configs/cpu_demo.yaml", ["learner.precision=bf16"]), {}),
                            (packed, {"moe/aux_loss": 0.1}),
                            (load_config("configs/cpu_demo.yaml", ["run.max_first_step_gap=null"]), {})]:  # fmt: skip
        check_first_gap(config, 1, {"rollout/mismatch_max": 7.1e-3, **metrics})


def test_the_one_transformers_patch_is_checked_applied_once_and_undone(monkeypatch):
    # rltrain changes a transformers module in one place (rltrain.forward.recurrent): a hybrid
    # model's convolution and scan replaced once, the originals kept and put back by unwrap; a scan
    # whose signature another transformers changed is left alone, and its kind is then not followed
    from rltrain.forward import recurrent

    model = families.build("qwen3.5")
    (module,) = recurrent.recurrent_modules(model)
    recurrent.unwrap(module)
    original = module.torch_chunk_gated_delta_rule
    batch = families.group_batch()
    families.in_layout(families.build("qwen3.5", attention.register()), batch, torch.zeros(batch.input_ids.shape),
                       "packed")  # fmt: skip
    assert module.torch_chunk_gated_delta_rule is not original
    assert module._rltrain_originals["torch_chunk_gated_delta_rule"] is original
    recurrent.expect(families.build("qwen3.5"), None)  # another model of the family: wrapped once
    assert module._rltrain_originals["torch_chunk_gated_delta_rule"] is original
    recurrent.unwrap(module)
    assert module.torch_chunk_gated_delta_rule is original and not module._rltrain_wrapped

    def renamed(query, key, value, g, beta, chunk_size=64, start_state=None, keep_final_state=False):
        raise AssertionError("never called with the arguments of another signature")

    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", renamed)
    assert not recurrent.wrappable(module, "torch_chunk_gated_delta_rule")
    unfollowed = needs(families.config("qwen3.5"), families.build("qwen3.5")).unfollowed
    assert "torch_chunk_gated_delta_rule" in unfollowed["linear_attention"]
