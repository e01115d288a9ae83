import pytest

from rltrain.batch import Segment
from rltrain.episodes.tools import ToolRunner, calculator, generate_with_tools


def encode(text):
    return [ord(ch) for ch in text]


def scripted(replies):
    """A generator that plays back segments per sequence, recording what it was asked."""
    calls = []

    def generate(prompts, max_tokens, seeds):
        calls.append((prompts, max_tokens, seeds))
        out = []
        for prompt, budget in zip(prompts, max_tokens):
            text = replies[prompt[0]].pop(0)
            ids = encode(text)[:budget]
            out.append(
                Segment(ids, [-0.5] * len(ids), text[:budget], "length" if len(text) > budget else "stop")
            )
        return out

    return generate, calls


def test_tool_output_is_appended_with_tool_mask_zero_and_generation_continues():
    generate, calls = scripted({1: ["<tool:calculator>6*7</tool>", " so 42!"], 2: ["plain!"]})
    runner = ToolRunner(["calculator"], timeout_s=1.0, max_output_chars=50)
    c1, c2 = generate_with_tools(generate, encode, [[1], [2]], 64, runner, max_calls=2, seeds=[10, 20])
    call, result, rest = "<tool:calculator>6*7</tool>", "<result>42</result>", " so 42!"
    assert c1.text == call + result + rest
    # policy tokens 1, tool output 0, policy again 1
    assert c1.tool_mask == [1] * len(call) + [0] * len(result) + [1] * len(rest)
    assert c1.logprobs == [-0.5] * len(call) + [0.0] * len(result) + [-0.5] * len(rest)
    assert c1.tool_calls == 1 and c1.tool_errors == 0 and c1.finish_reason == "stop"
    assert c2.text == "plain!" and c2.tool_mask == [1] * 6
    # round 2 continues only sequence 1, from prompt + everything so far, with the budget left and a new seed
    prompts, max_tokens, seeds = calls[1]
    assert prompts == [[1] + encode(call + result)]
    assert max_tokens == [64 - len(call) - len(result)]
    assert seeds[0] != 10


def test_tool_budget_and_call_limit():
    # the tool output would overrun a 30-token budget: it is cut and the completion counts as truncated
    generate, _ = scripted({1: ["<tool:calculator>1+1</tool>"]})
    runner = ToolRunner(["calculator"], 1.0, 50)
    (c,) = generate_with_tools(generate, encode, [[1]], 30, runner, max_calls=3, seeds=[0])
    assert len(c.token_ids) == 30 and c.finish_reason == "length" and c.truncated
    assert c.tool_mask.count(0) == 30 - len("<tool:calculator>1+1</tool>")
    # max_calls=0: no tool runs; the round stopped at </tool> without its end of turn, so the model
    # is told so inside the turn (tool mask 0) and goes on, and the call over the limit is counted
    generate, calls = scripted({1: ["<tool:calculator>1+1</tool>", " 2!"]})
    (c,) = generate_with_tools(generate, encode, [[1]], 100, runner, max_calls=0, seeds=[0])
    refusal = "<result>error: no tool calls left</result>"
    assert c.text == "<tool:calculator>1+1</tool>" + refusal + " 2!" and len(calls) == 2
    assert (c.tool_calls, c.errors, c.tool_mask.count(0)) == (0, {"limit": 1}, len(refusal))


def test_a_malformed_tag_that_stopped_generation_is_told_and_counted():
    # "<tool:two words>" is no call (names are \w+), but generation stopped at its </tool>: the turn
    # goes on with the format's error instead of ending without its end of turn
    generate, calls = scripted({1: ["<tool:two words>1</tool>", " sorry!"]})
    (c,) = generate_with_tools(generate, encode, [[1]], 200, ToolRunner(["calculator"], 1.0, 50), 2, [0])
    told = "<result>error: a tool call is <tool:NAME>ARGUMENT</tool></result>"
    assert c.text == "<tool:two words>1</tool>" + told + " sorry!"
    # counted as an environment's episode counts a malformed call (one episode state for both paths)
    assert (c.tool_calls, c.errors, c.tool_errors, c.finish_reason) == (0, {"bad_call": 1}, 1, "stop")
    assert calls[1][2][0] != calls[0][2][0]  # the next round samples with a new seed


def test_failing_tool_reports_error_to_the_model_and_counts_it():
    generate, _ = scripted({1: ["<tool:calculator>__import__('os')</tool>", "ok!"]})
    (c,) = generate_with_tools(generate, encode, [[1]], 200, ToolRunner(["calculator"], 1.0, 80), 2, [0])
    assert "<result>error: ValueError: only arithmetic is allowed</result>" in c.text
    assert c.tool_errors == 1 and c.errors == {"tool_raised": 1}  # the kind an episode's raising tool has


def test_calculator():
    assert calculator("(2 + 3) * 4") == "20"
    assert calculator("7 / 2") == "3.5"
    assert calculator("-3 ** 2") == "-9"
    for bad in ["x + 1", "open('f')", "2 ** 10000"]:
        with pytest.raises(ValueError):
            calculator(bad)


def test_python_tool_prints_its_stdout_or_its_error():
    runner = ToolRunner(["python"], 5.0, 100, isolate=False)
    assert runner("python", "print(sum(range(5)))") == ("<result>10</result>", True)
    out, ok = runner("python", "1 / 0")
    assert not ok and out == "<result>error: ZeroDivisionError: division by zero</result>"
