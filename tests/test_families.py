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
RECURRENT = {"falcon-h1"}  # Mamba-2 layers beside attention: padded rows only (docs/models.md)
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
}


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_every_family_is_exact_padded_packed_and_as_a_prefix_tree_or_refused(family):
    layouts = ("padded",) if family in RECURRENT else ("padded", "packed", "tree")
    gaps = families.worst_differences(family, layouts)
    print(family, gaps)
    for layout, (logprob_gap, grad_gap) in gaps.items():
        assert logprob_gap <= 1e-5 and grad_gap <= 1e-5, (layout, logprob_gap, grad_gap)
    model_needs = needs(families.config(family))
    assert set(model_needs.features()) == ASKS.get(family, set())
    problem = layout_problem(model_needs, "learner", packing=True, sharing="auto")
    if family in RECURRENT:  # one line naming the layers and the setting that runs them
        assert "mamba layers" in problem and "learner.packing=false" in problem and "\n" not in problem
        assert not shares(model_needs)  # auto leaves them unshared
        assert layout_problem(model_needs, "learner", packing=False, sharing="auto") is None
        assert "learner.prefix_sharing=false" in layout_problem(
            model_needs, "learner", packing=False, sharing=True
        )
    else:
        assert problem is None and shares(model_needs)


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


def test_a_model_with_recurrent_layers_is_refused_before_any_actor_in_packed_rows(tmp_path):
    from rltrain.models.resolve import check_model

    folder = tmp_path / "falcon"
    families.build("falcon-h1").save_pretrained(folder)
    config = load_config("configs/cpu_demo.yaml", [f"model.name_or_path={folder}"])
    with pytest.raises(ConfigError) as refused:
        check_model(config, str(folder))
    line = str(refused.value)
    assert line.startswith("learner:") and "mamba layers" in line and "learner.packing=false" in line
    assert "\n" not in line
    padded = load_config("configs/cpu_demo.yaml", [f"model.name_or_path={folder}", "learner.packing=false"])
    check_model(padded, str(folder))  # padded rows and auto's sharing (off for it) run it


@pytest.mark.slow
@pytest.mark.parametrize("model", ["builtin:tiny-gpt-oss", "builtin:tiny-gemma3"])
def test_a_windowed_family_trains_through_the_cli_exactly_with_vllm_packing_and_sharing(
    model, tmp_path, ray_cluster
):
    # gpt-oss (a window of 8, sinks, 4 experts) and Gemma 3 (sliding and full layers, the logit
    # soft-cap) on the built-in tokenizer, completions of up to 24 tokens (longer than the window):
    # 2 learners, ZeRO-2, packing and prefix sharing on, vLLM. The engine's log-probs equal the
    # learners' at every step, and with plain SGD the first update is one learner's, each sequence
    # padded in one micro-batch under transformers' own attention, unshared
    from test_e2e import final_weights, run_trainer
    from transformers import AutoModelForCausalLM

    from rltrain.config import BUILTIN_MODELS
    from rltrain.run.diagnostics import relative_difference

    sgd = [f"model.name_or_path={model}", "learner.optimizer=sgd", "learner.lr=0.5", "learner.max_grad_norm=0",
           "learner.warmup_steps=0", "rollout.max_new_tokens=24", "run.checkpoint_every=1"]  # fmt: skip
    out, one = tmp_path / "run", tmp_path / "one"
    run_trainer(out, *sgd, "run.steps=3", "learner.prefix_sharing=true", env=ray_cluster)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["rollout/mismatch_max"] <= 1e-4, row
        assert row["perf/prefix_shared_fraction"] > 0.3  # each group's prompt computed once
    run_trainer(one, *sgd, "run.steps=1", "learner.num_learners=1", "learner.zero_stage=0", "learner.packing=false",
                "learner.micro_batch_size=16", "learner.prefix_sharing=false", env=ray_cluster)  # fmt: skip
    start = AutoModelForCausalLM.from_pretrained(out / f"tiny_{BUILTIN_MODELS[model]}_model").state_dict()
    step_1 = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_1" / "hf").state_dict()
    update = {k: step_1[k] - start[k] for k in start}
    reference = {k: v - start[k] for k, v in final_weights(one).items()}
    assert relative_difference(update, reference) < 1e-5
