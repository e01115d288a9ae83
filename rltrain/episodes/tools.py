"""Tool calls during rollouts, and the tool masks they produce.

A completion calls a tool by writing ``<tool:NAME>ARGUMENT</tool>``. Generation stops at
``</tool>``, the tool runs (time-limited), its output ``<result>...</result>`` is appended to the
sequence with ``tool_mask`` 0 (it is not the policy's action, so it is excluded from the loss and
from the token totals), and generation continues until the completion ends or the token budget
(``max_new_tokens``, tool output included) runs out.

No ray, no deepspeed: :func:`generate_with_tools` takes the generator as a callable, so the loop is
shared by the vLLM and transformers backends and tested with a scripted one.
"""

from __future__ import annotations

import ast
import math
import operator
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rltrain.episodes.parsers import NO_CALLS_LEFT, TagParser
from rltrain.sandbox import DEFAULT_LIMITS, Limits, run_python

if TYPE_CHECKING:
    from rltrain.batch import Completion, Segment

STOP = TagParser.stop[0]
TAG = TagParser()


def calculator(expression: str) -> str:
    """Evaluate arithmetic: + - * / // % ** and parentheses over numbers, nothing else.

    Args:
        expression: The arithmetic expression, for example 12 + 7 * 3.
    """
    ops = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
        ast.Pow: operator.pow,
        ast.USub: operator.neg,
        ast.UAdd: operator.pos,
    }

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            if isinstance(node.op, ast.Pow) and abs(ev(node.right)) > 100:
                raise ValueError("exponent too large")
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.operand))
        raise ValueError("only arithmetic is allowed")

    value = ev(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


class ToolRunner:
    """Runs the enabled tools with a time limit and cuts their output. The python tool runs in
    :mod:`rltrain.sandbox` (limits, no network, its own folder); ``isolate=False`` keeps only the
    limits."""

    def __init__(
        self,
        enabled: Sequence[str],
        timeout_s: float,
        max_output_chars: int,
        limits: Limits = DEFAULT_LIMITS,
        isolate: bool = True,
    ):
        self.enabled, self.timeout_s, self.max_output_chars = set(enabled), timeout_s, max_output_chars
        self.limits, self.isolate = limits, isolate

    @classmethod
    def from_config(cls, tools, enabled: Sequence[str] | None = None) -> ToolRunner:
        """From a ``rollout.tools`` config section (``enabled``: in place of its tool list)."""
        box = tools.sandbox
        limits = Limits(memory_mb=box.memory_mb, cpu_s=math.ceil(tools.timeout_s) + 1,
                        processes=box.processes, file_size_mb=box.file_size_mb)  # fmt: skip
        enabled = tools.enabled if enabled is None else enabled
        return cls(enabled, tools.timeout_s, tools.max_output_chars, limits, box.require_isolation)

    def __call__(self, name: str, argument: str) -> tuple[str, bool]:
        """Returns ``(output text, ok)``; a failure's text starts with ``error:``."""
        try:
            if name not in self.enabled:
                raise ValueError(f"unknown tool {name!r}")
            if name == "calculator":
                out, ok = calculator(argument), True
            else:
                result = run_python(argument, self.timeout_s, self.limits, self.isolate)
                out, ok = (result.stdout, True) if result.ok else (f"error: {result.error}", False)
        except Exception as e:  # a tool's failure is the model's observation, never the run's
            out, ok = f"error: {type(e).__name__}: {e}", False
        return f"<result>{out.strip()[: self.max_output_chars]}</result>", ok


PYTHON = ToolRunner(["python"], 2.0, 200)  # the python tool's settings; rollout.tools in a run


def python(code: str) -> str:
    """Run a Python program in a sandbox (no network, limited memory and time) and return what it prints.

    Args:
        code: The program; print the values you want to see.
    """
    output, ok = PYTHON("python", code)
    output = output.removeprefix("<result>").removesuffix("</result>")
    if not ok:
        raise RuntimeError(output.removeprefix("error: "))
    return output


# generate(prompts, max_tokens, seeds) -> one Segment per prompt
GenerateFn = Callable[[list[list[int]], list[int], list[int]], "list[Segment]"]
SEED_STRIDE = 1_000_003  # each generation round of a sequence samples with seed + round * SEED_STRIDE


def generate_with_tools(
    generate: GenerateFn,
    encode: Callable[[str], list[int]],
    prompts: list[list[int]],
    max_new_tokens: int,
    tools: ToolRunner | None,
    max_calls: int,
    seeds: list[int],
) -> list[Completion]:
    """Generate one completion per prompt, running tool calls between generation rounds.

    ``generate(prompts, max_tokens, seeds)`` returns one :class:`Segment` per prompt and must stop
    at ``</tool>`` (keeping it in the output) when tools are on. Per-request seeds make a rollout a
    function of (weights, prompt, seed), so a resumed run samples what an uninterrupted one did.
    """
    from rltrain.batch import Completion  # torch: imported when a rollout runs, not with the tools
    from rltrain.episodes.episode_state import EpisodeLimits, EpisodeState

    # (the prompts are the data's, already within their limit; the budget is the completion's)
    limits = EpisodeLimits(max_new_tokens, sys.maxsize, sys.maxsize, max_tool_calls=max_calls)
    states = [EpisodeState(limits, Completion()) for _ in prompts]
    rounds = [0] * len(prompts)
    active = list(range(len(prompts)))
    while active:
        segments = generate(
            [prompts[i] + states[i].c.token_ids for i in active],
            [states[i].room() for i in active],
            [seeds[i] + rounds[i] * SEED_STRIDE for i in active],
        )
        still_active = []
        for i, seg in zip(active, segments):
            state, c = states[i], states[i].c
            c.take(seg)
            c.text += seg.text
            c.finish_reason = seg.finish_reason
            rounds[i] += 1
            # a round that stopped at the call's stop string goes on with the call's result or its
            # error (it has no end-of-turn token yet): a malformed call, one over the limit and a
            # tool that failed are counted by kind, as in episodes
            turn = TAG.parse(seg.text) if tools is not None and seg.finish_reason == "stop" else None
            if turn is None or not (turn.calls or turn.errors):
                continue
            if turn.errors or not state.calls_left():
                kind, message = turn.errors[0] if turn.errors else ("limit", NO_CALLS_LEFT)
                state.count(kind)
                output = TAG.format_result(message)
            else:
                output, ok = tools(turn.calls[0].name, turn.calls[0].arguments)
                c.tool_calls += 1
                if not ok:
                    state.count("tool_raised")
            c.text += output
            if state.add(encode(output)):
                still_active.append(i)
            else:
                c.finish_reason = "length"
        active = still_active
    done = [state.c for state in states]
    return done
