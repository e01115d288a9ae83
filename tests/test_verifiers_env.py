"""verifiers environments through the gateway (rltrain.episodes.verifiers_env): a taskset of the
tests' own (tests/vf_sums.py) run by verifiers' SingleAgentEnv with rltrain's in-process harness,
against the gateway's real HTTP server and a scripted engine (as in tests/test_gateway.py)."""

import json
import re
from pathlib import Path

import pytest
from test_gateway import LOGPROB, TOKENIZER, ScriptedEngine, encode

from rltrain.config import load_config
from rltrain.episodes.agents import AgentRunner
from rltrain.rewards.functions import VERIFIERS_ENV
from rltrain.run.scoring import episode_metrics, user_code_calls
from rltrain.run.user_code import NEVER_STOPS

pytest.importorskip("verifiers")
TESTS = Path(__file__).resolve().parent


def episodes(kwargs: str, reply, n: int, *overrides: str):
    """The first ``n`` tasks of vf_sums (``env.kwargs``) as one rollout; the rows and the episodes."""
    from rltrain.episodes.verifiers_env import task_rows

    config = load_config(None, ["env.name=verifiers:vf_sums", f"env.kwargs={kwargs}", "reward.functions={env: 1.0}",
                                "rollout.max_new_tokens=384", "rollout.tools.enabled=[]", *overrides])  # fmt: skip
    runner = AgentRunner(config, TOKENIZER)
    rows = task_rows(runner.episodes.env, n)
    try:
        return rows, runner.run(ScriptedEngine(reply), rows, list(range(n)))
    finally:
        runner.server.stop()


def test_a_verifiers_task_with_a_local_mcp_tool_is_one_gateway_sequence_scored_by_its_own_rewards(
    monkeypatch,
):
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # verifiers serves the toolset as `python -m vf_sums`
    replies = {}

    def reply(prompt):  # the calculator first, then its result as the answer
        text = TOKENIZER.decode(prompt)
        if "<tool_response>" in text:
            return encode(text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0].strip())
        a, b = re.findall(r"What is (\d+) \+ (\d+)\?", text)[-1]
        call = json.dumps({"name": "calc_add", "arguments": {"a": int(a), "b": int(b)}})
        replies[text] = encode(f"<tool_call>\n{call}\n</tool_call>")
        return replies[text]

    rows, (c,) = episodes("{num_tasks: 1, task: {tools: true}}", reply, 1)
    assert rows == [{"prompt": "What is 12 + 13?", "answer": "", "task": 0, "key": rows[0]["key"]}]
    assert c.finish_reason == "stop" and not c.failures and c.tool_calls == 1
    # the opening offers the toolset's tool; the episode is the call, the tool's answer, the reply
    assert "calc_add" in TOKENIZER.decode(c.prompt_ids)
    assert TOKENIZER.decode(c.token_ids).count("<tool_response>\n25\n</tool_response>") == 1
    # token-in/token-out: the mask is 1 exactly on the engine's two replies, with their log-probs
    (call,) = replies.values()
    assert [t for t, m in zip(c.token_ids, c.tool_mask) if m] == call + encode("25")
    assert c.logprobs == [LOGPROB if m else 0.0 for m in c.tool_mask]
    assert [x["finish_reason"] for x in c.calls] == ["tool_calls", "stop"]
    # the trace's reward: correct (1, weight 1) + brief (1, weight 0.5) = 1.5; scores by name too
    assert c.env_reward == 1.5 and c.agent_reward is None
    assert c.env_metrics == {"reward/correct": 1.0, "reward/brief": 1.0, "reply_chars": 2.0}
    assert episode_metrics([c])["env/reward/correct"] == 1.0


def test_an_endless_taskset_is_read_lazily_keys_stay_in_their_clients_and_max_turns_cuts_to_length(
    monkeypatch,
):
    import os

    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    keys_in_environment = []  # seen while an episode's call was in flight (a subprocess inherits them)

    def reply(prompt):  # the calculator, always: the second call is past env.max_turns=1
        keys_in_environment.extend(v for v in os.environ.values() if v.startswith("rlt-"))
        call = json.dumps({"name": "calc_add", "arguments": {"a": 1, "b": 2}})
        return encode(f"<tool_call>\n{call}\n</tool_call>")

    # a taskset without end (load() a generator that never stops): two tasks read, two episodes
    rows, done = episodes("{endless: true, task: {tools: true}}", reply, 2, "env.max_turns=1")
    assert [r["task"] for r in rows] == [0, 1] and keys_in_environment == []
    # verifiers refused each episode's second call (max turns): cut, as a length finish
    assert [c.finish_reason for c in done] == ["length", "length"] and not any(c.failures for c in done)
    assert all([x["finish_reason"] for x in c.calls] == ["tool_calls"] for c in done)


def test_a_verifiers_error_ends_its_episode_alone_and_is_counted_never_the_runs_end():
    # task 1's reward raises; tasks 0 and 2 are answered 25 (12 + 13 = 25: task 0 right)
    rows, done = episodes("{num_tasks: 3, task: {broken: [1]}}", lambda p: encode("25"), 3)
    assert [c.finish_reason for c in done] == ["stop", "error", "stop"]
    assert [c.env_reward for c in done] == [1.5, None, 0.5]  # task 2: brief only (0.5)
    assert "the taskset's own bug (task 1)" in done[1].failures[VERIFIERS_ENV]
    calls = user_code_calls(done, {}, VERIFIERS_ENV)[VERIFIERS_ENV]
    assert (calls.called, calls.failed) == (3, 1) and VERIFIERS_ENV in NEVER_STOPS
    # the failed episode reports no scores: the means are over the two that did
    assert episode_metrics(done)["env/reward/correct"] == 0.5  # (1 + 0) / 2


@pytest.mark.slow
def test_a_verifiers_taskset_trains_through_the_cli_and_is_evaluated_by_its_own_rewards(tmp_path):
    from test_e2e import HF, TESTS_ON_PATH, logged_rows, run_trainer

    out = tmp_path / "run"
    # (a Ray instance of the run's own: its generator actor imports the taskset from PYTHONPATH)
    # 24 tasks: the last 4 held out; one step of 4 tasks x 4 episodes, evaluated before and after it;
    # the step's tasks (run.seed 0's order) are 10, 18, 16 and 14; the reward of 10 and 18 raises
    # (the taskset's own bug): their episodes fail alone
    done = run_trainer(out, HF, "env.name=verifiers:vf_sums", "env.kwargs={num_tasks: 24, task: {broken: [10, 18]}}",
                       "reward.functions={env: 1.0}", "algorithm.overlong=none", "run.steps=1", "run.eval_every=1",
                       "eval.num_prompts=4", "run.save_rollouts_every=1", env=TESTS_ON_PATH)  # fmt: skip
    first, row = logged_rows(out)
    assert row["rollout/gateway_calls"] == 1.0
    # 2 tasks x 4 episodes failed: shown once, kept, counted
    assert row["failures/verifiers_environment"] == 8.0 == row["failures/outside_policy"]
    assert done.stderr.count("the verifiers environment failed (") == 1
    assert "the taskset's own bug" in (out / "errors" / "verifiers_environment.txt").read_text()
    # the trace's reward is the environment's: its functions' scores add up to it, by their weights
    # (reward/env, as every reward figure, and env/* are over the 8 episodes that did not fail)
    assert row["reward/env"] == pytest.approx(row["env/reward/correct"] + 0.5 * row["env/reward/brief"])
    assert "env/reply_chars" in row  # the taskset's metric
    for r in (first, row):  # held out: the environment's own rewards, on episodes that did not fail
        assert r["eval/failed"] == 0.0 and "eval/env/reward/correct" in r
        assert r["eval/env_reward"] == pytest.approx(
            r["eval/env/reward/correct"] + 0.5 * r["eval/env/reward/brief"]
        )
    samples = [json.loads(line) for line in (out / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(samples) == 16 and all(s["messages"][0]["content"].startswith("What is ") for s in samples)
    assert {s["prompt_index"] for s in samples} <= set(range(20))  # training tasks only


def test_the_documented_taskset_runs_unchanged(tmp_path, monkeypatch):
    from rltrain.episodes.verifiers_env import task_rows

    text = (TESTS.parent / "docs" / "environments.md").read_text().split("## Environments from verifiers")[1]
    (tmp_path / "mysums.py").write_text(text.split("```python\n", 1)[1].split("```", 1)[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    config = load_config(
        None, ["env.name=verifiers:mysums", "reward.functions={env: 1.0}", "rollout.max_new_tokens=64"]
    )
    runner = AgentRunner(config, TOKENIZER)
    try:
        rows = task_rows(runner.episodes.env, 3)
        done = runner.run(ScriptedEngine(lambda p: encode("4")), rows, [0, 1, 2])
    finally:
        runner.server.stop()
    assert [r["prompt"] for r in rows] == ["What is 0 + 3?", "What is 1 + 3?", "What is 2 + 3?"]
    assert [c.env_reward for c in done] == [0.0, 1.0, 0.0]  # "4" answers 1 + 3 alone
