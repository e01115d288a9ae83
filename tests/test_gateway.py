"""The agent gateway (rltrain.episodes.gateway, rltrain.episodes.agents): the official openai client
against the real HTTP server, token-in/token-out sequences and masks, splits, concurrency, failing
agents and refused requests. The engine is scripted (it answers what the chat template would
render), so each sequence can be compared with the one ChatRenderer.conversation builds."""

import sys
import time

import gateway_agents
import pytest

from rltrain.batch import Segment
from rltrain.config import load_config
from rltrain.episodes.agents import AgentRunner
from rltrain.episodes.chat import ChatRenderer, canonical
from rltrain.models.tiny import build_tokenizer
from rltrain.rollout.backends import decode
from rltrain.run.scoring import episode_metrics, training_sequences, user_code_calls
from rltrain.run.user_code import NEVER_STOPS

TOKENIZER = build_tokenizer()
AGENT = ["agent.entrypoint=gateway_agents:run", "rollout.tools.enabled=[]", "reward.functions={agent: 1.0}",
         "rollout.max_new_tokens=384"]  # fmt: skip
LOGPROB = -0.5  # every sampled token's, as the scripted engine reports it


class ScriptedEngine:
    """generate(prompts, max_tokens, seeds): for each prompt, ``reply(prompt ids)`` (ids ending with
    the end-of-turn token); records each call's batch size."""

    def __init__(self, reply, tokenizer=TOKENIZER, seconds: float = 0.0):
        self.reply, self.tokenizer, self.seconds, self.batches = reply, tokenizer, seconds, []

    def __call__(self, prompts, max_tokens, seeds):
        self.batches.append(len(prompts))
        time.sleep(self.seconds)  # a real engine's call takes a while: requests arrive meanwhile
        out = []
        for prompt, room in zip(prompts, max_tokens):
            ids = self.reply(prompt)[:room]
            done = ids[-1:] == [self.tokenizer.eos_token_id]
            text = decode(self.tokenizer, ids)  # as the engines decode a completion
            out.append(Segment(ids, [LOGPROB] * len(ids), text, "stop" if done else "length", [0] * len(ids)))
        return out


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False) + [TOKENIZER.eos_token_id]


def serve(rows, engine, *overrides, tokenizer=TOKENIZER):
    runner = AgentRunner(load_config(None, [*AGENT, *overrides]), tokenizer)
    try:
        return runner.run(engine, rows, list(range(len(rows))))
    finally:
        if runner.server is not None:
            runner.server.stop()


CALLS = ['<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>',
         '<tool_call>{"name": "calculator", "arguments": {"expression": "5 * 2"}}</tool_call>',
         "It is 10."]  # fmt: skip


def test_a_three_call_tool_loop_is_one_sequence_of_sampled_ids_and_template_differences():
    # the k-th call's prompt holds k generation prompts: the engine answers the k-th reply
    engine = ScriptedEngine(lambda p: encode(CALLS[TOKENIZER.decode(p).count("<|im_start|>assistant") - 1]))
    (c,) = serve([{"id": "a", "mode": "tool_loop"}], engine)
    history = [canonical(m) for m in gateway_agents.HELD["a"]]
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in history if m["role"] == "tool"] == ["5", "10"]  # the agent ran the calls
    # exactly what an environment's episode builds from the same conversation (ChatRenderer):
    # the opening prompt, each reply's sampled ids, the template's tokens for each tool message
    prompt, ids, mask = ChatRenderer(TOKENIZER, gateway_agents.TOOLS).conversation(history)
    assert c.prompt_ids == prompt and c.token_ids == ids and c.tool_mask == mask
    sampled = [encode(text) for text in CALLS]
    assert sum(mask) == sum(map(len, sampled))  # 1 exactly on the sampled ids
    assert c.logprobs == [LOGPROB if m else 0.0 for m in mask]
    assert c.earlier == [] and c.agent_reward == 1.0 and c.finish_reason == "stop" and c.tool_calls == 2
    assert [call["finish_reason"] for call in c.calls] == ["tool_calls", "tool_calls", "stop"]
    assert [call["sequence"] for call in c.calls] == [0, 0, 0]


def test_an_agent_that_rewrites_its_history_splits_into_sequences_each_token_in_token_out():
    engine = ScriptedEngine(lambda p: encode("Five."))
    (c,) = serve([{"id": "r", "mode": "rewrite"}], engine)
    # calls 1-2 share a history (one sequence); call 3's history replaced it (a second one)
    assert [call["sequence"] for call in c.calls] == [0, 0, 1]
    (first,) = c.earlier
    for seq, replies in [(first, 2), (c, 1)]:
        # the mask is 1 exactly on the replies' sampled ids: "Five." and the end-of-turn token each
        assert sum(seq.tool_mask) == replies * len(encode("Five."))
        assert [t for t, m in zip(seq.token_ids, seq.tool_mask) if m] == encode("Five.") * replies
    renderer = ChatRenderer(TOKENIZER)
    assert c.prompt_ids == renderer.opening(
        [{"role": "user", "content": "Summary: we spoke of 2 + 3."}, {"role": "user", "content": "So?"}]
    )
    assert episode_metrics([c])["rollout/gateway_splits"] == 1.0
    # both sequences train, each with the episode's advantage
    prompts, sequences, episode = training_sequences([c.prompt_ids], [c])
    assert sequences == [first, c] and prompts == [first.prompt_ids, c.prompt_ids]
    assert episode.tolist() == [0, 0]  # both parts of completion 0: its advantage


def test_a_template_that_rewrites_earlier_turns_splits_the_episode_under_full_render_only():
    from test_chat_templates import REASONING, tokenizer_for

    qwen3 = tokenizer_for("qwen3")  # drops earlier turns' reasoning once a user message follows
    reply = qwen3.encode(REASONING + "It is 5.", add_special_tokens=False) + [qwen3.eos_token_id]
    engine = ScriptedEngine(lambda p: reply, qwen3)
    for render, splits in [("full", 1), ("last_turn", 0)]:
        (c,) = serve([{"id": "t", "mode": "twice"}], engine, f"env.render={render}", tokenizer=qwen3)
        assert len(c.earlier) == c.errors.get("gateway_template_rewrites", 0) == splits, render
        assert c.agent_reward == 1.0 and len(c.calls) == 2  # served either way
        for seq in [*c.earlier, c]:  # each sequence holds the sampled ids as sampled
            assert [t for t, m in zip(seq.token_ids, seq.tool_mask) if m] == reply * (2 - splits)


class NewWeightsEachCall(ScriptedEngine):
    """In-flight updates at their most frequent: new weights between every two engine calls, so
    the k-th call samples with policy version k."""

    def __call__(self, prompts, max_tokens, seeds):
        segments = super().__call__(prompts, max_tokens, seeds)
        for seg in segments:
            seg.versions = [len(self.batches) - 1] * len(seg.token_ids)
        return segments


def test_weights_that_change_between_an_agents_calls_version_its_tokens_and_bound_its_staleness():
    import torch

    from rltrain.data import Prompt
    from rltrain.run.scoring import ScoredGroups, drop_stale

    (c,) = serve([{"id": "r", "mode": "rewrite"}], NewWeightsEachCall(lambda p: encode("Five.")))
    (first,) = c.earlier
    n = len(encode("Five."))
    # calls 1-2 (the first sequence) were sampled by versions 0 and 1, call 3 (the second) by 2
    assert [v for v, m in zip(first.versions, first.tool_mask) if m] == [0] * n + [1] * n
    assert [v for v, m in zip(c.versions, c.tool_mask) if m] == [2] * n
    scored = ScoredGroups([Prompt(0, [], "", {})], [c], torch.ones(1), {})
    # learners at version 2: the first sequence's version-0 tokens are 2 versions old, past a bound
    # of 1, though every token of the episode's last sequence is fresh: the episode is dropped
    kept = drop_stale(scored, version=2, max_staleness=1, group_size=1)
    assert kept.completions == [] and kept.metrics["rollout/stale_dropped"] == 1
    # ages of the 3n sampled tokens: 2 (n of them), 1 (n), 0 (n) -> mean 1, max 2
    assert kept.metrics["rollout/staleness_mean"] == pytest.approx(1.0)
    assert kept.metrics["rollout/staleness_max"] == 2
    assert drop_stale(scored, version=2, max_staleness=2, group_size=1).completions == [c]


def test_64_concurrent_agents_are_served_by_one_generator_in_shared_engine_calls():
    engine = ScriptedEngine(lambda p: encode("Ok."), seconds=0.2)
    rows = [{"id": str(i), "mode": "once", "reward": i % 2} for i in range(64)]
    completions = serve(rows, engine, "agent.concurrency=64")
    assert [c.agent_reward for c in completions] == [i % 2 for i in range(64)]  # each its own episode
    assert all(c.token_ids[c.tool_mask.index(1) :] == encode("Ok.") for c in completions)
    assert sum(engine.batches) == 64 and max(engine.batches) > 8, engine.batches  # batched


def test_agents_that_hang_or_raise_end_their_episode_alone_and_are_counted():
    engine = ScriptedEngine(lambda p: encode("Ok."))
    rows = [{"id": "h", "mode": "hang"}, {"id": "x", "mode": "raise"}, {"id": "o", "mode": "once"}]
    hung, raised, fine = serve(rows, engine, "agent.timeout_s=3")
    assert [c.finish_reason for c in (hung, raised, fine)] == ["error", "error", "stop"]
    assert hung.agent_reward is None and raised.agent_reward is None and fine.agent_reward == 1.0
    assert "agent.timeout_s" in hung.failures["agent"] and "the agent's own bug" in raised.failures["agent"]
    assert hung.errors["gateway_timeout"] == 1 and raised.errors["gateway_raised"] == 1
    assert sum(hung.tool_mask) == len(encode("Ok."))  # what it sampled before it hung is kept
    calls = user_code_calls([hung, raised, fine], {})["agent"]
    assert (calls.called, calls.failed) == (3, 2) and "agent" in NEVER_STOPS  # counted, never the run's end


def test_requests_with_no_key_another_episodes_key_or_a_finished_one_are_refused_and_counted():
    engine = ScriptedEngine(lambda p: encode("Ok."))
    rows = [{"id": "f", "mode": "finished"}, {"id": "i", "mode": "intruder", "target": "f"}]
    finished, intruder = serve(rows, engine)
    # finished episode's key; another episode's key; no key; own key on another's endpoint: 401 each;
    # its own key with another temperature than the run's: 400, never sampled
    assert gateway_agents.HELD["i"] == [401, 401, 401, 401, 400]
    assert finished.errors["gateway_unauthorized"] == 4  # charged to the rollout (its first episode)
    assert intruder.errors["gateway_sampling"] == 1
    assert intruder.agent_reward == 1.0 and len(intruder.calls) == 1  # its own call was served


def test_a_reply_that_comes_after_its_episode_closed_is_refused_and_touches_nothing():
    # the engine takes 2 s, the agent 1 s at most: its episode closes (timed out) with the call in
    # flight and is handed on; the reply that comes a second later is refused (410), counted as
    # late on the episode, and leaves the handed-on sequence as it was (no sampled token in it)
    engine = ScriptedEngine(lambda p: encode("Ok."), seconds=2.0)
    (late,) = serve([{"id": "l", "mode": "once"}], engine, "agent.timeout_s=1")
    time.sleep(0.5)  # (long enough for the late reply to have been taken, had it been)
    assert late.finish_reason == "error" and late.errors["gateway_late"] == 1
    assert late.token_ids == [] and late.calls == []
    assert episode_metrics([late])["rollout/gateway_late"] == 1.0


def test_a_message_of_a_role_the_api_does_not_have_is_refused_naming_the_roles():
    from rltrain.episodes.gateway import ChatRequest, Refused

    with pytest.raises(Refused) as refusal:
        ChatRequest.check({"messages": [{"role": "wizard", "content": "hi"}]})
    assert refusal.value.status == 400 and refusal.value.kind == "bad_request"
    assert str(refusal.value) == (
        "messages.0.role: Input should be 'system', 'developer', 'user', 'assistant' or 'tool'"
    )
    for role in ("system", "developer", "user", "assistant", "tool"):
        ChatRequest.check({"messages": [{"role": role, "content": "hi"}]})


def test_content_parts_other_than_text_are_refused_in_one_line_never_dropped():
    import base64
    import io

    from PIL import Image

    from rltrain.episodes.gateway import ChatRequest, Refused

    def parts(*extra: dict) -> dict:
        return {"messages": [{"role": "user", "content": [{"type": "text", "text": "How many?"}, *extra]}]}

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    png = f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"
    ChatRequest.check(parts())  # text parts alone are served
    refused = {}
    for name, part in {
        "remote": {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        "undecodable": {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        "an image": {"type": "image_url", "image_url": {"url": png}},
        "audio": {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    }.items():
        with pytest.raises(Refused) as refusal:  # (a bad image: for a model that takes images)
            ChatRequest.check(parts(part), images=name in ("remote", "undecodable"))
        assert refusal.value.status == 400 and "\n" not in str(refusal.value)
        refused[name] = str(refusal.value)
    assert refused["remote"].startswith("messages.0.content.1.image_url: remote image URLs are not fetched")
    assert "cannot be decoded as an image" in refused["undecodable"]
    # a good image is refused where the model takes none, before it is decoded (a reply to the text
    # alone would be trained on; tests/test_vision_run.py serves one to a vision-language model)
    assert refused["an image"].startswith("messages.0.content.1: this model takes no images")
    assert (
        refused["audio"]
        == "messages.0.content.1: content parts of type 'input_audio' are not served (text only)"
    )


def test_an_image_part_is_decoded_once_and_never_for_a_text_model(monkeypatch):
    import base64
    import io

    from PIL import Image

    import rltrain.media
    from rltrain.episodes.gateway import ChatRequest, Refused

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG")
    png = f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png}}]}]}
    decoded, raw_bytes = [], rltrain.media.raw_bytes
    monkeypatch.setattr(rltrain.media, "raw_bytes", lambda *a, **k: decoded.append(1) or raw_bytes(*a, **k))
    with pytest.raises(Refused):  # a text model: refused before any byte of it is decoded
        ChatRequest.check(body, images=False)
    assert decoded == []
    request = ChatRequest.check(body, images=True)
    (message,) = [canonical(m) for m in request.message_dicts()]  # what the gateway renders
    assert message["content"] == [{"type": "image", "image": buffer.getvalue()}] and decoded == [1]


def test_an_episode_that_closes_before_its_call_takes_it_counts_the_call_as_to_a_finished_episode(
    monkeypatch,
):
    # the agent's timeout closes the episode after the call found it (its key checked) but before
    # the call took it (busy): the call is refused as one to a finished episode (401), counted by
    # the gateway; the handed-on episode is left as it was (nothing counted on it, not busy)
    from rltrain.episodes import gateway as module
    from rltrain.episodes.gateway import Refused

    runner = AgentRunner(load_config(None, AGENT), TOKENIZER)
    gateway = runner.gateway
    e = gateway.open({"id": "closing"}, seed=0)
    check = module.ChatRequest.check

    def closing_meanwhile(*args, **kwargs):
        gateway.close(e)
        return check(*args, **kwargs)

    monkeypatch.setattr(module.ChatRequest, "check", closing_meanwhile)
    with pytest.raises(Refused) as refusal:
        gateway.begin(e.id, e.key, {"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
    assert refusal.value.status == 401 and gateway.unauthorized == 1
    assert e.counts == {} and not e.busy and e.sequences() == []


def test_a_request_may_repeat_the_runs_sampling_and_ask_for_nothing_else():
    from rltrain.episodes.gateway import Refused, Sampling

    run = Sampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0)
    served = [{}, {"temperature": 1.0, "top_p": 1}, {"top_k": -1}, {"n": 1}, {"stream": False},
              {"logprobs": False, "top_logprobs": 0}, {"response_format": {"type": "text"}},
              {"presence_penalty": 0.0, "stop": []}, {"tool_choice": "auto"}, {"max_tokens": 8}]  # fmt: skip
    for body in served:
        run.check(body)  # the client's defaults ask for nothing: served as if left out
    refused = [{"temperature": 0.7}, {"top_p": 0.9}, {"n": 2}, {"stream": True}, {"logprobs": True},
               {"presence_penalty": 0.5}, {"stop": ["\n"]}, {"logit_bias": {"50": 100}},
               {"response_format": {"type": "json_object"}}, {"tool_choice": "required"}]  # fmt: skip
    for body in refused:
        with pytest.raises(Refused) as refusal:
            run.check(body)
        assert refusal.value.status == 400 and refusal.value.kind == "sampling", body


def test_no_bad_request_wedges_an_episode_or_touches_another():
    # a few hundred malformed requests (bad JSON, wrong types, missing fields, bad tool calls and
    # tool messages, out-of-policy sampling, a huge body, a wrong key or none), two calls at once,
    # then a valid call on the same episode; another episode runs beside it
    engine = ScriptedEngine(lambda p: encode("Ok."), seconds=0.2)  # (the two calls at once overlap)
    fuzzed, other = serve(
        [{"id": "z", "mode": "fuzz"}, {"id": "o", "mode": "once"}], engine, "agent.timeout_s=300"
    )
    *statuses, (_, concurrent, _) = gateway_agents.HELD["z"]
    assert len(statuses) > 200
    for name, status, text in statuses:
        # a 4xx with one line saying what is wrong; a huge body may instead be cut off (0)
        assert 400 <= status < 500 or (status == 0 and name.startswith("huge")), (name, status, text)
        if status:
            assert "\n" not in __import__("json").loads(text)["error"]["message"], (name, text)
    assert {s for n, s, _ in statuses if n.startswith(("wrong key", "no key", "not bearer"))} == {401}
    assert {s for n, s, _ in statuses if n.startswith("sampling")} == {400}
    assert concurrent == [200, 409]
    # the valid call after all that was served, and so were the two of the episode's own calls
    assert fuzzed.agent_reward == 1.0 and [c["finish_reason"] for c in fuzzed.calls] == ["stop", "stop"]
    assert fuzzed.errors["gateway_bad_request"] > 100 and fuzzed.errors["gateway_concurrent"] == 1
    assert other.agent_reward == 1.0 and len(other.calls) == 1
    assert not any(k.startswith("gateway_") and k != "gateway_unauthorized" for k in other.errors)


def test_a_long_history_is_rendered_off_the_servers_loop(monkeypatch):
    # one agent sends a ~100k-token history three times (each refused as over the prompt limit, once
    # rendered); its rendering is made to take 2 s more, as a slow template on a long history
    # would. Another agent's calls meanwhile wait for no render of it: each well under the 2 s that
    # one render on the server's own loop would hold every request up
    opening = ChatRenderer.opening

    def slow_on_long_histories(self, messages):
        ids = opening(self, messages)
        if len(ids) > 50_000:
            time.sleep(2.0)
        return ids

    monkeypatch.setattr(ChatRenderer, "opening", slow_on_long_histories)
    engine = ScriptedEngine(lambda p: encode("Ok."))
    huge, timed = serve([{"id": "h", "mode": "huge_history"}, {"id": "t", "mode": "timed"}], engine)
    assert huge.errors["gateway_prompt_too_long"] == 3  # each long history was rendered
    seconds = gateway_agents.HELD["t"]
    assert len(seconds) == 4 and max(seconds) < 1.0, seconds


def test_an_episode_closed_during_a_slow_render_keeps_its_sequences_as_they_were_handed_on(monkeypatch):
    # the agent times out while its call's prompt renders (a long history, a slow template): close
    # hands the episode's sequences on, and the render finishing afterwards must not change them
    # (it opened the episode's first sequence after the close); the call is refused as late
    import threading

    from rltrain.episodes.gateway import Refused

    runner = AgentRunner(load_config(None, AGENT), TOKENIZER)
    gateway, rendering, release = runner.gateway, threading.Event(), threading.Event()
    opening = ChatRenderer.opening

    def slow(self, messages):
        rendering.set()
        release.wait(10)
        return opening(self, messages)

    monkeypatch.setattr(ChatRenderer, "opening", slow)
    e = gateway.open({"id": "slow"}, seed=0)
    outcome: list = []

    def call() -> None:
        try:
            outcome.append(
                gateway.begin(
                    e.id, e.key, {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
                )
            )
        except Refused as refused:
            outcome.append(refused)

    caller = threading.Thread(target=call)
    caller.start()
    assert rendering.wait(10)
    gateway.close(e)  # the agent's timeout
    handed_on = [list(c.token_ids) for c in e.sequences()]
    release.set()
    caller.join(10)
    assert e.sequences() == [] and handed_on == []  # nothing opened after the close
    (refused,) = outcome
    assert isinstance(refused, Refused) and refused.status == 410 and refused.kind == "late"
    assert e.counts == {"late": 1} and not e.busy


@pytest.mark.parametrize(
    "entrypoint, expected",
    {
        "no module": ("no_such_agents:run", "agent.entrypoint: cannot load 'no_such_agents:run'"),
        "not async": (
            "gateway_agents:calculator",
            "must be `async def run(row, base_url, api_key, model) -> float`",
        ),
        "with the env": ("gateway_agents:run env.name=builtin:guess", "an episode is one or the other"),
    }.values(),
    ids=["no module", "not async", "with the env"],
)
def test_an_agent_that_does_not_load_stops_before_any_actor_in_one_line(
    entrypoint, expected, tmp_path, capsys, monkeypatch
):
    from test_config_cli import fails_with_one_line

    import rltrain.run.launch

    monkeypatch.setattr(rltrain.run.launch, "connect_ray", lambda *_: pytest.fail("Ray was started"))
    spec, *more = entrypoint.split()
    argv = ["--config", "configs/cpu_demo.yaml", f"run.output_dir={tmp_path}", f"agent.entrypoint={spec}",
            "rollout.tools.enabled=[]", "reward.functions={agent: 1.0}", "sft_warmup.steps=0", *more]  # fmt: skip
    fails_with_one_line(argv, expected, capsys)


def test_the_chain_agent_asks_the_questions_the_chain_environment_asks():
    from rltrain.envs import ChainEnv
    from rltrain.episodes.agents import load_agent

    chain_agent = sys.modules[load_agent("examples/chain_agent.py:run").__module__]
    env = load_config("configs/cpu_agent.yaml").env.kwargs
    assert chain_agent.TASK == {key: env[key] for key in ("links", "high")}  # (the demo compares the two)
    row = {"answer": "1234"}
    assert ChainEnv(**chain_agent.TASK).reset(row) == ChainEnv(**env).reset(row)


@pytest.mark.slow
def test_the_chain_task_as_a_black_box_agent_trains_through_the_cli(tmp_path, ray_cluster):
    """The chain agent of examples/ through the CLI: warmed up on the chain's demonstrations written
    as an agent's log (examples/chain_demonstrations.py), then trained while new weights reach the
    engine mid-rollout (in-flight updates, one step of staleness allowed)."""
    import json
    import subprocess
    import sys

    from test_e2e import REPO, logged_rows, run_trainer

    demos = tmp_path / "demos.jsonl"
    subprocess.run([sys.executable, "examples/chain_demonstrations.py", str(demos), "--limit", "16"],
                   cwd=REPO, check=True, capture_output=True)  # fmt: skip
    out = tmp_path / "run"
    run_trainer(out, "agent.entrypoint=examples/chain_agent.py:run", "data.source=builtin:chain",
                "reward.functions={agent: 1.0}", "rollout.tools.enabled=[]", "algorithm.overlong=none",
                "rollout.max_new_tokens=48", "run.steps=3", "run.save_rollouts_every=1",
                "sft_warmup.steps=2", f"sft_warmup.source={demos}", "sft_warmup.batch_size=4",
                "rollout.inflight_updates=true", "rollout.max_staleness=1", env=ray_cluster)  # fmt: skip
    warm = json.loads((out / "sft_model" / "rltrain_sft.json").read_text())
    assert len(warm["loss"]) == 2  # two warm-up steps on the file's conversations
    rows = logged_rows(out)
    assert len(rows) == 3
    for row in rows:
        assert row["rollout/gateway_calls"] >= 1 and row["rollout/gateway_splits"] == 0
        assert "reward/agent" in row and "failures/agent" not in row  # the agent's reward, no failure
        assert row["rollout/staleness_max"] <= 1  # the bound holds on every token an agent was given
    # the first step's sequences, sampled by vLLM before any update, scored by the learners: the same log-probs
    assert rows[0]["rollout/mismatch_max"] < 1e-4
    samples = [json.loads(line) for line in (out / "rollouts" / "step_1.jsonl").read_text().splitlines()]
    assert len(samples) == 16  # 4 prompts x 4 episodes
    for s in samples:
        assert s["calls"] and s["calls"][0]["messages"] == 1  # the agent's opening question
        assert s["messages"][0]["content"].startswith("What is ") and s["messages"][1]["role"] == "assistant"
        assert len(s["completion_ids"]) == len(s["completion_mask"]) == len(s["completion_logprobs"])


def documented_agent(tmp_path, monkeypatch) -> None:
    """docs/agents.md's agent, pasted as it is into ``myagent.py`` on the path."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "agents.md").read_text()
    (tmp_path / "myagent.py").write_text(text.split("```python\n", 1)[1].split("```", 1)[0])
    monkeypatch.syspath_prepend(str(tmp_path))


def test_the_documented_agent_runs_unchanged_through_the_gateway(tmp_path, monkeypatch):
    documented_agent(tmp_path, monkeypatch)
    # the engine answers "It is 4." first, then "It is 5.": the agent asks again once, then is right
    engine = ScriptedEngine(
        lambda p: encode(f"It is {3 + TOKENIZER.decode(p).count('<|im_start|>assistant')}.")
    )
    (c,) = serve([{"prompt": "What is 2 + 3?", "answer": "5."}], engine, "agent.entrypoint=myagent:run")
    assert c.agent_reward == 1.0 and len(c.calls) == 2 and c.earlier == []


def test_calls_that_no_longer_fit_end_with_a_length_finish_the_documented_agent_reads(tmp_path, monkeypatch):
    # the documented command's limits (configs/cpu_demo.yaml: 80 new tokens an episode, prompts of
    # up to 128 tokens), and a policy that never stops on its own (as the untrained tiny model):
    # every reply is cut by its length, so the agent's next call cannot extend the sequence, and its
    # growing history soon no longer fits a new one. Each such call is answered, empty, with
    # finish_reason "length" (it was HTTP 400, an exception in the agent)
    documented_agent(tmp_path, monkeypatch)
    engine = ScriptedEngine(lambda p: TOKENIZER.encode("1 2 3 " * 100, add_special_tokens=False))
    (c,) = serve([{"prompt": "What is 2 + 3?", "answer": "5."}], engine, "agent.entrypoint=myagent:run",
                 "rollout.max_new_tokens=80", "data.max_prompt_tokens=128")  # fmt: skip
    assert "agent" not in c.failures and c.agent_reward == 0.0  # it ran its 4 tries and returned
    reasons = [call["finish_reason"] for call in c.calls]
    assert len(reasons) == 4 and set(reasons) == {"length"}
    assert c.calls[0]["completion_tokens"] == 80  # the first reply: sampled to the episode's budget
    assert [call["completion_tokens"] for call in c.calls[-2:]] == [0, 0]  # then no room: nothing sampled
    assert c.errors["gateway_length"] >= 2 and sum(c.tool_mask) + sum(sum(s.tool_mask) for s in c.earlier) > 0
    # an agent's own bound on a sequence's opening prompt takes the place of data.max_prompt_tokens
    (roomy,) = serve([{"prompt": "What is 2 + 3?", "answer": "5."}], engine, "agent.entrypoint=myagent:run",
                     "rollout.max_new_tokens=80", "agent.max_prompt_tokens=400", "rollout.max_model_len=512")  # fmt: skip
    assert max(len(seq.prompt_ids) for seq in [*roomy.earlier, roomy]) > 128


def test_held_out_agents_that_all_failed_before_a_call_are_scored_as_agents():
    from rltrain.batch import Completion
    from rltrain.data import Prompt
    from rltrain.run.eval import evaluate

    class Generators:  # every episode's agent raised before its first call
        def submit(self, requests, seeds, greedy=False):
            return [Completion(finish_reason="error", by_agent=True) for _ in requests]

        def collect(self, completions):
            return completions

    prompts = [Prompt(i, [], "5", {"prompt": "What is 2 + 3?"}) for i in range(2)]
    result = evaluate(Generators(), prompts, scorer=None, own="agent")
    assert result["eval/success"] == 0.0 and result["eval/agent_reward"] == 0.0  # not an environment's
    assert "eval/env_reward" not in result
