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
from rltrain.diagnostics import layout_config, relative_difference, updates_after_one_step
from rltrain.envs import GuessEnv
from rltrain.episodes.agents import AgentRunner
from rltrain.episodes.chat import ChatRenderer
from rltrain.forward import sequence_logprobs
from rltrain.losses import sft_cross_entropy
from rltrain.rollout import GeneratorActor
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
    """The guessing game's episodes on vLLM: the environment's, then the same engine serving the
    game written as a black-box agent through the gateway (half of them restate their history
    once, so they split into two training sequences)."""
    config = Config.model_validate({**ENV, "algorithm": {"group_size": 4}})
    actor = GeneratorActor(config, guessing_model, engine_index=0)
    rows = episode_rows(4, seed=3)
    completions = actor.rollout([r for r in rows for _ in range(4)], seeds=list(range(16)))
    prompts = [Prompt(i, [], r["answer"], r) for i, r in enumerate(rows)]
    rewards = torch.tensor([c.env_reward or 0.0 for c in completions])
    agent = Config.model_validate({**ENV, "env": {}, "agent": {"entrypoint": "gateway_agents:run"},
                                   "reward": {"functions": {"agent": 1.0}}, "algorithm": {"group_size": 4}})  # fmt: skip
    runner = AgentRunner(agent, actor.tokenizer)
    try:
        agents = [{**r, "mode": "guess", "rewrite": j % 2} for r in rows for j in range(4)]
        through_gateway = runner.run(actor.generate, agents, seeds=list(range(16)))
    finally:
        runner.server.stop()
    del actor  # the engine's KV cache
    gateway_rewards = torch.tensor([c.agent_reward or 0.0 for c in through_gateway])
    return (
        config,
        ScoredGroups(prompts, completions, rewards, {}),
        ScoredGroups(prompts, through_gateway, gateway_rewards, {}),
    )


def test_vllm_episodes_have_environment_tokens_between_sampled_turns(episodes):
    _, scored, _ = episodes
    multi = [c for c in scored.completions if c.turns >= 2]
    assert len(multi) >= 4, [c.turns for c in scored.completions]
    for c in multi:
        first_gap = c.tool_mask.index(0)
        assert 1 in c.tool_mask[first_gap:]  # sampled tokens again after the environment's
        assert c.logprobs[first_gap] == 0.0 and all(lp < 0 or lp == 0 for lp in c.logprobs)
        assert c.messages[0]["role"] == "user" and c.messages[1]["role"] == "assistant"


def test_gateway_episodes_on_vllm_are_token_in_token_out_and_split_where_the_agent_rewrote(
    episodes, guessing_model
):
    _, _, gateway = episodes
    model = AutoModelForCausalLM.from_pretrained(guessing_model)
    splits = [c for c in gateway.completions if c.earlier]
    assert len(splits) >= 4 and all(c.errors["gateway_splits"] == 1 for c in splits)
    sequences = [s for c in gateway.completions for s in [*c.earlier, c]]
    assert sum(s.turns >= 2 for s in sequences) >= 2  # replies, then the agent's messages, then replies
    for s in sequences:
        # the engine's log-prob of every sampled token is the model's on the sequence as recorded:
        # the ids the policy sampled, not a re-encoding of their text
        ids = torch.tensor([s.prompt_ids + s.token_ids])
        ours = sequence_logprobs(model, ids, torch.ones_like(ids), temperature=1.0)[0][0][len(s.prompt_ids) :]
        sampled = torch.tensor(s.tool_mask).bool()
        assert (torch.tensor(s.logprobs)[sampled] - ours[sampled]).abs().max() < 1e-4
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.tool_mask) if not m)


def test_token_mode_update_on_episodes_is_layout_invariant(
    episodes, guessing_model, ray_local, kept_learners
):
    # the environment's episodes and the gateway's (split ones included) in one batch
    config, scored, gateway = episodes
    batch = build_batch(ScoredGroups.concat([scored, gateway]), config, pad_id=0)
    assert len(batch) == 32 + sum(len(c.earlier) for c in gateway.completions)  # split: 2 sequences
    assert (batch.response_mask * (1 - batch.tool_mask)).sum() > 0  # masked tokens inside completions

    def layout(learners, micro_batch, zero, denominator="token", budget=None, sharing=True):
        raw = layout_config(
            learners, micro_batch, zero, denominator, budget, prefix_sharing=sharing
        ).model_dump()
        raw["data"]["max_prompt_tokens"], raw["rollout"]["max_new_tokens"] = 64, 120
        return Config.model_validate(raw)

    # the reference computes each sequence in its own row; the layouts share each micro-batch's
    # common prompts (learner.prefix_sharing=true: a group's 4 episodes, a split episode's parts)
    layouts = {
        "2 ranks x micro-batches of 3, ZeRO-2": layout(2, 3, 2),
        "2 ranks packed (budget 400), ZeRO-3": layout(2, 1, 3, budget=400),
    }
    reference, *updates, naive_split, naive_one = updates_after_one_step(
        [layout(1, 16, 0, sharing=False), *layouts.values(), layout(2, 3, 2, None), layout(1, 16, 0, None)],
        guessing_model, batch,
    )  # fmt: skip
    diffs = {name: relative_difference(u, reference) for name, u in zip(layouts, updates)}
    naive = relative_difference(naive_split, naive_one)
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
