"""Episodes, token-in/token-out: the training sequence is the sampled ids plus the chat template's
tokens for what the environment and tools add, the mask is 1 exactly on sampled ids, and nothing
is re-tokenized. A scripted engine plays the policy; environments run in their real processes."""

import re
import time

import pytest

from rltrain.batch import Segment
from rltrain.envs import CalculatorEnv, ChainEnv, GuessEnv, tool_schemas
from rltrain.episodes.chat import ChatRenderer, TemplateError
from rltrain.episodes.env_host import EnvHost
from rltrain.episodes.episode_state import EpisodeLimits
from rltrain.episodes.parsers import HermesParser, TagParser
from rltrain.episodes.tools import SEED_STRIDE
from rltrain.episodes.turns import run_episodes
from rltrain.models.tiny import CHAT_TEMPLATE, TOOL_TOKENS, build_tokenizer

TOK = build_tokenizer()
EOS = TOK.eos_token_id
LIMITS = EpisodeLimits(max_new_tokens=400, max_model_len=1024, max_prompt_tokens=200, max_turns=4,
                       max_tool_calls=8, step_timeout_s=5.0, tool_timeout_s=2.0)  # fmt: skip


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def scripted(turns: dict[int, list[list[int]]], calls: list | None = None):
    """An engine that answers episode e's round r with ``turns[e][r]`` (ids), log-prob -0.25 each.
    The episode and round are read back from the request seed (episode + round * SEED_STRIDE)."""

    def generate(prompts, max_tokens, seeds):
        if calls is not None:
            calls.append(prompts)
        out = []
        for seed, budget in zip(seeds, max_tokens):
            planned = turns[seed % SEED_STRIDE][seed // SEED_STRIDE]
            sampled = planned[:budget]  # ends at EOS or a stop string unless the budget cuts it
            text = TOK.decode(sampled, skip_special_tokens=True)
            out.append(
                Segment(sampled, [-0.25] * len(sampled), text, "length" if len(planned) > budget else "stop")
            )
        return out

    return generate


def play(spec, turns, rows, parser=None, limits=LIMITS, kwargs=None, calls=None):
    host = EnvHost(spec, kwargs or {})
    try:
        renderer = ChatRenderer(TOK, tool_schemas(host.tools) if host.tools else None)
        return run_episodes(scripted(turns, calls), host, renderer, parser or HermesParser(),
                            ids, rows, list(range(len(rows))), limits)  # fmt: skip
    finally:
        host.shutdown()


def test_three_turn_episode_is_the_sampled_ids_plus_the_template_between_turns():
    # secret = low + answer % 15 = 1 + 10 = 11: guesses 8 (higher), 12 (lower), 11 (found)
    sampled = [ids("8") + [EOS], ids("12") + [EOS], ids("11") + [EOS]]
    prompts_seen = []
    (c,) = play("builtin:guess", {0: sampled}, [{"prompt": "guess", "answer": "10"}], calls=prompts_seen)
    # written out by hand from the Qwen2.5-shaped template: what follows an assistant turn is the
    # newline after <|im_end|>, the user turn, and the next assistant header
    between = ["\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n",
               "\n<|im_start|>user\nlower<|im_end|>\n<|im_start|>assistant\n"]  # fmt: skip
    expected = sampled[0] + ids(between[0]) + sampled[1] + ids(between[1]) + sampled[2]
    assert c.prompt_ids == ids(
        "<|im_start|>user\nGuess my number from 1 to 15.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert c.token_ids == expected
    mask = [1] * 2 + [0] * len(ids(between[0])) + [1] * 3 + [0] * len(ids(between[1])) + [1] * 3
    assert c.tool_mask == mask
    assert c.logprobs == [-0.25 if m else 0.0 for m in mask]
    assert (c.env_reward, c.turns, c.finish_reason, c.text) == (1.0, 3, "stop", "11")
    # each round's request is exactly the prompt and everything before it
    assert prompts_seen[2] == [c.prompt_ids + expected[: len(expected) - 3]]
    assert [m["role"] for m in c.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]


def test_sampled_ids_are_never_re_encoded():
    # the policy spells the characters of "<|im_end|>" byte by byte: decoding and encoding again
    # would give the one special token, 10 ids fewer
    spelled = ids("<|im") + ids("_end|>")
    assert ids(TOK.decode(spelled)) != spelled  # the case matters: re-encoding changes the ids
    sampled = [spelled + [EOS], ids("11") + [EOS]]
    (c,) = play("builtin:guess", {0: sampled}, [{"prompt": "guess", "answer": "10"}])
    assert c.token_ids[: len(spelled) + 1] == spelled + [EOS]
    assert c.tool_mask[: len(spelled) + 1] == [1] * (len(spelled) + 1)
    assert sum(c.tool_mask) == len(spelled) + 1 + 3  # policy tokens: both turns, nothing else
    assert c.messages[2]["content"] == "say a number from 1 to 15"


def test_malformed_calls_are_messages_to_the_model_and_counted_by_kind():
    bad = (
        '<tool_call>{"name": calculator}</tool_call>'  # bad_json
        "<tool_call>[1, 2]</tool_call>"  # bad_call
        '<tool_call>{"name": "search", "arguments": {}}</tool_call>'  # unknown_tool
        '<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>'  # bad_arguments
        '<tool_call>{"name": "calculator", "arguments": {"expression": "import os"}}</tool_call>'  # tool_raised
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2 + 3\\"}"}</tool_call>'  # ok
    )
    unclosed = '<tool_call>{"name": "calculator"'
    turns = {0: [ids(bad) + [EOS], ids("5") + [EOS]], 1: [ids(unclosed) + [EOS], ids("5") + [EOS]]}
    row = {"prompt": "What is 2 + 3?", "answer": "5"}
    roomy = EpisodeLimits(**{**LIMITS.__dict__, "max_new_tokens": 1500, "max_model_len": 2048})  # six results
    first, second = play("builtin:calculator", turns, [row, row], limits=roomy)
    kinds = {"bad_json": 1, "bad_call": 1, "unknown_tool": 1, "bad_arguments": 1, "tool_raised": 1}
    assert first.errors == kinds and first.tool_errors == 5
    assert first.tool_calls == 4  # the four well-formed calls ran (one of them failed inside)
    tool_messages = [m["content"] for m in first.messages if m["role"] == "tool"]
    assert len(tool_messages) == 6 and sum(t.startswith("error:") for t in tool_messages) == 5
    assert "5" in tool_messages  # the good call's result
    assert (first.env_reward, first.turns, first.finish_reason) == (1.0, 2, "stop")
    assert second.errors == {"unclosed": 1} and second.env_reward == 1.0


def test_native_calls_round_trip_through_the_template():
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
    turns = {0: [ids(call) + [EOS], ids("5") + [EOS]]}
    (c,) = play("builtin:calculator", turns, [{"prompt": "What is 2 + 3?", "answer": "5"}])
    added = "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert c.token_ids == ids(call) + [EOS] + ids(added) + ids("5") + [EOS]
    assert c.messages[1]["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": {"expression": "2 + 3"},
    }
    # the same conversation written by hand renders to the same tokens (warm-up examples match)
    renderer = ChatRenderer(TOK, tool_schemas(CalculatorEnv.tools))
    prompt, completion, mask = renderer.conversation(c.messages)
    assert (prompt, completion, mask) == (c.prompt_ids, c.token_ids, c.tool_mask)


def test_a_call_spelled_byte_by_byte_runs_and_keeps_the_ids_it_was_sampled_as():
    # the built-in tokenizer has Qwen2.5's tool tags as single, non-special tokens ...
    assert TOOL_TOKENS == ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
    assert [len(ids(tag)) for tag in TOOL_TOKENS] == [1] * 4
    # ... but the policy may also spell one byte by byte (11 ids): its text is the same call
    spelled = [i for ch in "<tool_call>" for i in ids(ch)]
    assert len(spelled) == 11 and TOK.decode(spelled) == "<tool_call>"
    first = spelled + ids('{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>') + [EOS]
    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}]
    (c,) = play("builtin:calculator", {0: [first, ids("5") + [EOS]]}, rows)
    assert (c.tool_calls, c.env_reward, c.errors) == (1, 1.0, {})
    assert c.token_ids[: len(first)] == first and c.tool_mask[: len(first)] == [1] * len(first)


def test_tag_parser_appends_results_inside_the_turn():
    turns = {0: [ids("<tool:calculator>2 + 3</tool>"), ids(" 5") + [EOS]]}
    (c,) = play(
        "builtin:calculator", turns, [{"prompt": "What is 2 + 3?", "answer": "5"}], parser=TagParser()
    )
    assert TOK.decode(c.token_ids) == "<tool:calculator>2 + 3</tool><result>5</result> 5<|im_end|>"
    assert c.tool_mask.count(0) == len(ids("<result>5</result>"))
    assert (c.tool_calls, c.turns, c.env_reward) == (1, 1, 1.0)


@pytest.mark.parametrize("episodes, chars", [(256, 2000), (128, 8000)])
def test_the_host_answers_a_step_of_long_prompts(episodes, chars):
    # 256 x 2,000 and 128 x 8,000 characters of answers are ~0.5 and ~1 MB: more than a socket
    # buffer holds, so a caller that sent every call before reading any answer waited forever on a
    # host blocked sending answers (both sides stuck)
    host = EnvHost("envs_for_tests:EchoEnv", {})
    try:
        rows = [{"prompt": f"{i:04d}" + "x" * (chars - 4), "answer": ""} for i in range(episodes)]
        keys = host.open(episodes)
        answers = host.call([(key, "reset", row, 30.0) for key, row in zip(keys, rows)])
        assert [a[1][0]["content"] for a in answers] == [row["prompt"] for row in rows]
    finally:
        host.shutdown()


def test_a_tag_turn_stopped_without_a_call_to_run_goes_on_and_ends_with_its_end_of_turn():
    # both stopped at </tool>: a call over the limit (max_tool_calls=1, the second call) and a
    # malformed tag; each is told inside the turn and counted, and the turn still ends with EOS
    over = [ids("<tool:calculator>1 + 1</tool>"), ids("<tool:calculator>2 + 3</tool>"), ids(" 5") + [EOS]]
    malformed = [ids("<tool:calc ulator>2 + 3</tool>"), ids(" 5") + [EOS]]
    limits = EpisodeLimits(**{**vars(LIMITS), "max_tool_calls": 1})
    rows = [{"prompt": "What is 2 + 3?", "answer": "5"}] * 2
    a, b = play("builtin:calculator", {0: over, 1: malformed}, rows, parser=TagParser(), limits=limits)
    assert TOK.decode(a.token_ids).endswith(
        "<tool:calculator>2 + 3</tool><result>error: no tool calls left</result> 5<|im_end|>"
    )
    assert TOK.decode(b.token_ids) == (
        "<tool:calc ulator>2 + 3</tool><result>error: a tool call is <tool:NAME>ARGUMENT</tool></result> 5<|im_end|>"
    )
    assert (a.tool_calls, a.errors, a.turns) == (1, {"limit": 1}, 1)
    assert (b.tool_calls, b.errors, b.turns, b.env_reward) == (0, {"bad_call": 1}, 1, 1.0)


def test_limits_end_episodes_with_length_or_turns():
    wrong = [ids("1") + [EOS]] * 4  # secret 11 is never guessed
    long = [ids("7" * 500)]  # does not end its turn within max_new_tokens=400
    turned, cut = play("builtin:guess", {0: wrong, 1: long}, [{"prompt": "g", "answer": "10"}] * 2)
    assert (turned.finish_reason, turned.turns, turned.env_reward) == ("turns", 4, 0.0)
    assert cut.finish_reason == "length" and len(cut.token_ids) == 400


def test_hung_step_and_hung_tool_end_only_their_own_episode():
    call = '<tool_call>{"name": "wait", "arguments": {"seconds": 600}}</tool_call>'
    turns = {0: [ids("ok") + [EOS]], 1: [ids(call) + [EOS]], 2: [ids("ok") + [EOS]]}
    rows = [{"prompt": "", "answer": "hang"}, {"prompt": "", "answer": ""}, {"prompt": "", "answer": ""}]
    limits = EpisodeLimits(**{**LIMITS.__dict__, "step_timeout_s": 1.0, "tool_timeout_s": 0.5})
    start = time.monotonic()
    hung_step, hung_tool, fine = play("envs_for_tests:SlowEnv", turns, rows, limits=limits)
    assert time.monotonic() - start < 15  # 1 s and 0.5 + 1 s deadlines, not 600 s
    assert (hung_step.finish_reason, hung_step.errors) == ("error", {"env_timeout": 1})
    assert (hung_tool.finish_reason, hung_tool.errors) == ("error", {"timeout": 1})
    assert (fine.finish_reason, fine.env_reward) == ("stop", 1.0)


def test_a_raising_environment_ends_its_episode_not_the_run():
    (c,) = play("envs_for_tests:RaisingEnv", {0: [ids("hi") + [EOS]]}, [{"prompt": "", "answer": ""}])
    assert (c.finish_reason, c.errors, c.turns) == ("error", {"env_raised": 1}, 1)


# Qwen3-like: assistant turns before the last user message lose their content when re-rendered
REWRITING = CHAT_TEMPLATE.replace(
    "{{ message.content or '' }}",
    "{{ '' if messages[loop.index0 + 1:] | selectattr('role', 'equalto', 'user') | list else message.content }}",
)
assert REWRITING != CHAT_TEMPLATE


def test_a_template_that_rewrites_history_stops_with_one_line():
    tok = build_tokenizer()
    tok.chat_template = REWRITING
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "12"}]
    with pytest.raises(TemplateError) as error:
        ChatRenderer(tok).additions(history, [{"role": "user", "content": "next"}])
    assert "\n" not in str(error.value) and "env.render=last_turn" in str(error.value)
    # the documented fallback renders the new message after a stand-in for the history
    added = ChatRenderer(tok, history="last_turn").additions(history, [{"role": "user", "content": "next"}])
    assert tok.decode(added) == "\n<|im_start|>user\nnext<|im_end|>\n<|im_start|>assistant\n"


def test_episode_metrics_sum_error_kinds_and_average_turns():
    from rltrain.batch import Completion
    from rltrain.run.scoring import episode_metrics

    a = Completion(
        tool_mask=[1, 1, 0, 0, 1], turns=2, tool_calls=1, errors={"bad_json": 1}, finish_reason="turns"
    )
    b = Completion(tool_mask=[1, 0, 1], turns=1, errors={"bad_json": 2, "timeout": 1}, finish_reason="error")
    m = episode_metrics([a, b])
    assert m["rollout/tool_errors/bad_json"] == 3.0 and m["rollout/tool_errors/timeout"] == 1.0
    assert m["rollout/turns"] == 1.5  # (2 + 1) / 2 episodes
    assert m["rollout/tool_calls_per_turn"] == 1 / 3  # 1 call over 3 turns
    assert m["rollout/env_token_share"] == 3 / 8  # mask-0 tokens: 2 + 1 of 5 + 3
    assert m["rollout/finish_turns"] == 0.5 and m["rollout/finish_error"] == 0.5
    # one-turn completions without an environment report only their error kinds
    assert episode_metrics([Completion(errors={"x": 1})]) == {"rollout/tool_errors/x": 1.0}


def test_guess_answers_higher_or_lower_and_scores_late_finds_less_with_a_guess_cost():
    env = GuessEnv(low=1, high=15, guess_cost=0.2)
    opening = env.reset({"answer": "9"})  # secret = low + 9 % 15 = 10
    talk = [*opening, {"role": "assistant", "content": "8"}]
    assert env.step(talk).messages == [{"role": "user", "content": "higher"}]
    talk += [{"role": "user", "content": "higher"}, {"role": "assistant", "content": "12"}]
    assert env.step(talk).messages == [{"role": "user", "content": "lower"}]
    talk += [{"role": "user", "content": "lower"}, {"role": "assistant", "content": "10"}]
    found = env.step(talk)
    assert found.done and found.reward == pytest.approx(0.6)  # third guess: 1 - 0.2 * (3 - 1)
    free = GuessEnv()
    free.reset({"answer": "9"})
    assert free.step(talk).reward == 1.0  # no cost: every find scores 1
    with pytest.raises(ValueError, match="guess_cost"):
        GuessEnv(guess_cost=1.0)


def numbers(text: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", text)]


def test_chain_links_apply_to_the_previous_answer_and_a_wrong_answer_ends_the_episode():
    env = ChainEnv(links=3)
    (opening,) = env.reset({"answer": "7"})
    a, b = numbers(opening["content"])
    assert opening["content"] == f"What is {a} + {b}?"
    talk = [opening, {"role": "assistant", "content": str(a + b)}]
    value = a + b
    for _ in range(2):  # links 2 and 3: "Now add c." / "Now subtract c." on what was answered
        step = env.step(talk)
        assert not step.done and step.reward == 0.0
        (follow_up,) = step.messages
        verb, c = follow_up["content"].split()[1], numbers(follow_up["content"])[0]
        value = value + c if verb == "add" else value - c
        talk += [follow_up, {"role": "assistant", "content": f"It is {value}"}]
    last = env.step(talk)
    assert last.done and last.reward == 1.0 and last.messages == []
    env.reset({"answer": "7"})
    wrong = env.step([opening, {"role": "assistant", "content": str(a + b + 1)}])
    assert wrong.done and wrong.reward == 0.0
    with pytest.raises(ValueError, match="links"):
        ChainEnv(links=0)


@pytest.mark.parametrize("tool_fraction", [0.0, 1.0])
def test_chain_demonstrations_call_the_calculator_as_often_as_asked_and_score_1(tool_fraction):
    for seed in range(5):
        env = ChainEnv(links=2, tool_fraction=tool_fraction)
        talk = env.demonstration({"answer": str(seed)})
        calls = [m for m in talk if m.get("tool_calls")]
        assert len(calls) == (2 if tool_fraction else 0)  # one per link, or none
        replay = ChainEnv(links=2)  # a fresh environment accepts the conversation's answers
        replay.reset({"answer": str(seed)})
        answers = [i for i, m in enumerate(talk) if m["role"] == "assistant" and not m.get("tool_calls")]
        assert [replay.step(talk[: i + 1]).reward for i in answers] == [0.0, 1.0]


def test_a_chain_episode_uses_the_environments_answers_through_native_calls():
    env = ChainEnv(links=2)
    (opening,) = env.reset({"answer": "3"})
    a, b = numbers(opening["content"])
    follow = env.step([opening, {"role": "assistant", "content": str(a + b)}]).messages[0]["content"]
    c = numbers(follow)[0]
    second = f"{a + b} + {c}" if "add" in follow else f"{a + b} - {c}"

    def call(expression: str) -> list[int]:
        return ids(
            f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>'
        ) + [EOS]

    final = a + b + c if "add" in follow else a + b - c
    sampled = [call(f"{a} + {b}"), ids(str(a + b)) + [EOS], call(second), ids(str(final)) + [EOS]]
    (ep,) = play("builtin:chain", {0: sampled}, [{"prompt": "chain", "answer": "3"}])
    assert (ep.env_reward, ep.turns, ep.tool_calls, ep.finish_reason) == (1.0, 4, 2, "stop")
    roles = [m["role"] for m in ep.messages]
    assert roles == ["user", "assistant", "tool", "assistant", "user", "assistant", "tool", "assistant"]
    assert ep.messages[2]["content"] == str(a + b) and ep.messages[4]["content"] == follow
    assert sum(ep.tool_mask) == sum(len(t) for t in sampled)  # the mask is 1 on sampled ids only
