"""Multi-turn episodes through the real engine and learners: vLLM plays the guessing game against
the environment's processes, and in `token` mode the update on those episodes (environment and
template tokens in the middle of sequences, masked out) is the same under every layout, while the
per-micro-batch mean is not."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltrain.config import Config
from rltrain.data import Prompt, episode_rows
from rltrain.envs import GuessEnv
from rltrain.losses import sft_cross_entropy
from rltrain.rollout import GeneratorActor
from rltrain.rollout.chat import ChatRenderer
from rltrain.run.diagnostics import layout_config, relative_difference, update_after_one_step
from rltrain.run.scoring import ScoredGroups, build_batch

pytestmark = pytest.mark.slow
ENV = {"env": {"name": "builtin:guess", "max_turns": 3}, "data": {"source": "builtin:guess", "max_prompt_tokens": 64},
       "rollout": {"max_new_tokens": 120}, "reward": {"functions": {"env": 1.0}}}  # fmt: skip


@pytest.fixture(scope="module")
def guessing_model(tiny_model_path, tmp_path_factory):
    """The tiny model after a few steps on the environment's demonstrations: it ends its turns
    with a number, so episodes have several turns (a random model never ends one)."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    renderer = ChatRenderer(tokenizer)
    examples = [renderer.conversation(GuessEnv().demonstration({"answer": str(k)})) for k in range(15)]
    length = max(len(p) + len(c) for p, c, _ in examples)
    ids = torch.full((len(examples), length), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (prompt, completion, m) in enumerate(examples):
        ids[i, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
        mask[i, len(prompt) : len(prompt) + len(completion)] = torch.tensor(m)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(60):
        loss = sft_cross_entropy(model(input_ids=ids).logits[:, :-1], ids[:, 1:], mask[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    out = tmp_path_factory.mktemp("guessing_model")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def episodes(guessing_model):
    config = Config.model_validate({**ENV, "algorithm": {"group_size": 4}})
    actor = GeneratorActor(config, guessing_model, engine_index=0)
    rows = episode_rows(4, seed=3)
    completions = actor.rollout([r for r in rows for _ in range(4)], seeds=list(range(16)))
    del actor  # the engine's KV cache
    prompts = [Prompt(i, [], r["answer"], r) for i, r in enumerate(rows)]
    rewards = torch.tensor([c.env_reward or 0.0 for c in completions])
    return config, ScoredGroups(prompts, completions, rewards, {})


def test_vllm_episodes_have_environment_tokens_between_sampled_turns(episodes):
    _, scored = episodes
    multi = [c for c in scored.completions if c.turns >= 2]
    assert len(multi) >= 4, [c.turns for c in scored.completions]
    for c in multi:
        first_gap = c.tool_mask.index(0)
        assert 1 in c.tool_mask[first_gap:]  # sampled tokens again after the environment's
        assert c.logprobs[first_gap] == 0.0 and all(lp < 0 or lp == 0 for lp in c.logprobs)
        assert c.messages[0]["role"] == "user" and c.messages[1]["role"] == "assistant"


def test_token_mode_update_on_episodes_is_layout_invariant(episodes, guessing_model, ray_local):
    config, scored = episodes
    batch = build_batch(scored, config, pad_id=0)
    assert (batch.response_mask * (1 - batch.tool_mask)).sum() > 0  # masked tokens inside completions

    def update(learners, micro_batch, zero, denominator="token", budget=None):
        raw = layout_config(learners, micro_batch, zero, denominator, budget).model_dump()
        raw["data"]["max_prompt_tokens"], raw["rollout"]["max_new_tokens"] = 64, 120
        return update_after_one_step(Config.model_validate(raw), guessing_model, batch)

    reference = update(1, 16, 0)
    diffs = {
        "2 ranks x micro-batches of 3, ZeRO-2": relative_difference(update(2, 3, 2), reference),
        "2 ranks packed (budget 400), ZeRO-3": relative_difference(update(2, 1, 3, budget=400), reference),
    }
    naive = relative_difference(update(2, 3, 2, None), update(1, 16, 0, None))
    print(f"multi-turn episodes: token-mode differences {diffs}; per-micro-batch mean: {naive:.3e}")
    assert max(diffs.values()) < 1e-5, diffs
    assert naive > 1e-2, naive


def test_agent_config_runs_and_writes_readable_rollouts(tmp_path, ray_cluster):
    # the demo's config, shortened: warm start on demonstrations, two GRPO steps, evaluation
    out = tmp_path / "run"
    overrides = ["sft_warmup.steps=10", "run.steps=2", "run.eval_every=2", "eval.num_prompts=16",
                 "run.save_rollouts_every=1", "run.checkpoint_every=0", "run.ray_num_cpus=2",
                 "algorithm.prompts_per_step=4", f"run.output_dir={out}"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_agent.yaml", *overrides],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
        env={**os.environ, **ray_cluster},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval/success" in rows[0] and "eval/success" in rows[-1]
    assert all(0 < r["rollout/turns"] <= 4 for r in rows[1:]) and "rollout/env_token_share" in rows[1]
    # fp32 on CPU, no staleness: the engine samples from exactly the learner's weights (multi-turn
    # episodes included), so the sampling log-probs match the learner's to rounding
    assert all(r["rollout/mismatch_kl"] < 1e-8 and r["rollout/mismatch_max"] < 1e-4 for r in rows[1:])
    samples = [json.loads(line) for line in (out / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 8  # prompts_per_step x group_size
    for s in samples:
        assert len(s["completion_ids"]) == len(s["completion_mask"]) == len(s["completion_logprobs"])
        assert s["completion_versions"] == [0] * len(s["completion_ids"])  # step 1: the first weights
        assert s["messages"][0]["role"] == "user" and s["messages"][1]["role"] == "assistant"
        assert sum(m["role"] == "assistant" for m in s["messages"]) == s["turns"]
        assert set(s["rewards"]) == {"env"} and s["finish_reason"] in {"stop", "length", "turns", "error"}
        # the logged log-probs are the sampled tokens' (negative), 0 exactly where the mask is 0
        assert all(
            (lp == 0.0) == (m == 0) or m == 1 for lp, m in zip(s["completion_logprobs"], s["completion_mask"])
        )
    assert (out / "final_model" / "config.json").exists()
