"""LoRA (model.lora): adapters on the learners, the reference as the same model with its adapters
off, adapter-only sync to vLLM, exact token-mode updates over layouts, checkpoints of the adapters
alone that resume exactly (and on another layout), and the two exports."""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from test_e2e import TESTS_ON_PATH, final_weights, logged_rows, run_trainer
from test_resume import stopped_after_step_2
from transformers import AutoModelForCausalLM

from rltrain.config import Config
from rltrain.diagnostics import layout_config, on_learners, relative_difference, synthetic_rollouts
from rltrain.learner.group import LearnerGroup
from rltrain.remote import gather

pytestmark = pytest.mark.slow
LORA = {"rank": 8, "alpha": 16}


def adapter_update(group: LearnerGroup) -> tuple[dict, dict]:
    """The adapters' change in one step, and the merged weights', on learners just started."""
    fetch = lambda: gather([group.gathered_state_ref(adapters_only=True)], group.names[:1], 60)[0]  # noqa: E731
    before, merged_before = fetch(), group.state_dict()
    group.train_step(synthetic_rollouts())
    after, merged_after = fetch(), group.state_dict()
    return {k: after[k] - before[k] for k in before}, {
        k: merged_after[k] - merged_before[k] for k in merged_before
    }


def with_lora(config: Config) -> Config:
    raw = config.model_dump()
    raw["model"]["lora"] = LORA
    return Config.model_validate(raw)


def test_the_adapters_update_is_the_same_over_layouts_and_zero_stages_in_token_mode(
    ray_local, kept_learners, tiny_model_path
):
    # 1 learner x 4 micro-batches of 2 (ZeRO-0) against 2 learners x micro-batches of 3 and 1 under
    # ZeRO 2 and 3 (the stages that partition), and packed (the tiny model's attention heads and
    # projections carry adapters); the per-micro-batch mean over the same two layouts (ZeRO-2) is
    # the control
    configs = [with_lora(layout_config(1, 2, 0, "token"))]
    configs += [with_lora(layout_config(2, 3, stage, "token")) for stage in (2, 3)]
    # and packed: 2 learners, rows of whole sequences under a 28-token budget (ZeRO-2)
    configs += [with_lora(layout_config(2, 1, 2, "token", max_tokens_per_micro_batch=28))]
    configs += [with_lora(layout_config(*lay, 2, None)) for lay in [(1, 2), (2, 3)]]
    (one, merged), *token, (naive_one, _), (naive_two, _) = on_learners(
        configs, tiny_model_path, lambda group, _: adapter_update(group)
    )
    layouts = ["ZeRO-2", "ZeRO-3", "packed, ZeRO-2"]
    token_diffs = {name: relative_difference(two, one) for name, (two, _) in zip(layouts, token)}
    naive_diff = relative_difference(naive_two, naive_one)
    print(f"adapters, token mode 2x(3+1) vs 1x4: {token_diffs}; per-micro-batch {naive_diff:.2e}")
    assert max(token_diffs.values()) < 1e-5, token_diffs
    assert naive_diff > 1e-2
    # B starts at 0, so the first step moves B alone; the weights outside the adapted modules do not move
    assert any(v.abs().max() > 0 for k, v in one.items() if "lora_B" in k)
    assert all(v.abs().max() == 0 for k, v in one.items() if "lora_A" in k)
    assert (
        merged["model.embed_tokens.weight"].abs().max() == 0 and merged["model.norm.weight"].abs().max() == 0
    )
    assert merged["model.layers.0.self_attn.q_proj.weight"].abs().max() > 0  # W + alpha/r * B @ A moved


def test_a_lora_run_syncs_adapters_to_vllm_resumes_exactly_and_exports_both(tmp_path, ray_cluster):
    env = {**TESTS_ON_PATH, **ray_cluster}
    # (the reference: adapters off); a warm start of 3 steps trains adapters too, exported merged
    common = ["run.steps=3", "model.lora.rank=8", "loss.kl_beta=0.01", "sft_warmup.steps=3"]
    run_trainer(tmp_path / "straight", *common, "run.checkpoint_every=2", env=env)
    rows = logged_rows(tmp_path / "straight")
    tiny, warm = (AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / name).state_dict()
                  for name in ("tiny_model", "sft_model"))  # fmt: skip
    assert torch.equal(warm["model.embed_tokens.weight"], tiny["model.embed_tokens.weight"])  # frozen
    assert not torch.equal(
        warm["model.layers.0.self_attn.q_proj.weight"], tiny["model.layers.0.self_attn.q_proj.weight"]
    )
    # the engine samples with the adapter the learners trained: their log-probs agree at every step
    assert max(r["rollout/mismatch_max"] for r in rows) < 1e-4 and rows[0]["sync/probe_gap"] < 1e-4
    full_bytes = sum(
        p.numel() * 4
        for p in AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "final_model").parameters()
    )
    # the tiny model: 2 layers x 7 projections of width 64-256 at rank 8 = 16,384 floats, 64 KiB
    assert [r["sync/bytes"] for r in rows] == [16384 * 4] * 3 and 16384 * 4 < full_bytes
    assert rows[-1]["train/kl"] > 0  # the policy moved away from its adapters-off self
    # a checkpoint holds the adapters (and their optimizer state), not the base model
    step_2 = tmp_path / "straight" / "checkpoints" / "step_2"
    module = torch.load(step_2 / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)[
        "module"
    ]
    assert len(module) == 28 and all(".lora_" in k for k in module)
    assert (
        json.loads((step_2 / "adapter" / "adapter_config.json").read_text())["r"] == 8
        and not (step_2 / "hf").exists()
    )

    # final_adapter/ on the base model it names (the warm start's) computes what final_model/ (merged) does
    straight = tmp_path / "straight"
    named = json.loads((straight / "final_adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"
    ]
    assert Path(named) == straight / "sft_model"
    base = AutoModelForCausalLM.from_pretrained(named)
    adapted, merged = (
        PeftModel.from_pretrained(base, straight / "final_adapter"),
        AutoModelForCausalLM.from_pretrained(straight / "final_model"),
    )
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])
    with torch.no_grad():
        assert (adapted(ids).logits - merged(ids).logits).abs().max() < 1e-5

    # resumed from step 2 on 1 learner with ZeRO-3 (the layout-free state: the adapters and their
    # optimizer state): the same weights as the uninterrupted run (a same-layout resume, DeepSpeed's
    # own state, is tests/test_resume.py's, whose checkpoints hold what this one's do, adapters aside)
    want = final_weights(straight)
    stopped_after_step_2(straight, tmp_path / "elastic")
    run_trainer(tmp_path / "elastic", *common, "run.resume=true", "learner.num_learners=1", "learner.zero_stage=3",
                env=env)  # fmt: skip
    got = final_weights(tmp_path / "elastic")
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst < 1e-5, worst
