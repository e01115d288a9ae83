"""verifiers environments (PyPI ``verifiers``, ``pip install 'rltrain[verifiers]'``) through the
gateway (no ray).

``env.name: verifiers:<taskset id>`` names a verifiers taskset: a module, importable where rltrain
runs, that exports a ``vf.Taskset`` subclass in ``__all__`` (an Environments Hub id installs as
one). ``env.kwargs`` are the taskset's settings (its config's fields), ``env.max_turns`` the
agent's model calls per episode. The taskset's tasks are the run's rows, in ``load()`` order
(held out: the last ``eval.num_prompts``).

Each episode runs as verifiers runs one (``SingleAgentEnv.run_slot``: the task's setup, the
harness, its rewards and metrics), with the harness this module supplies: a chat loop in the
generator's own process (no uv, no sandbox, no tunnel) that calls the model through verifiers'
interception, which forwards to the episode's endpoint on the generator's gateway. The gateway
records every call token-in/token-out (:mod:`rltrain.episodes.gateway`), so the sequences, masks
and log-probs trained on are the engine's, never a re-tokenisation of the trace's messages.
The task's local MCP toolsets serve their tools as verifiers serves them; this harness calls them.

The episode's reward (reward.functions' ``env``) is the trace's weighted reward; each reward
function's score and each metric are logged as ``env/reward/<name>`` and ``env/<name>`` (held
out: ``eval/env/...``). A verifiers error (the taskset's code, a toolset, the harness) ends that
episode only, with finish reason ``error``; it is counted and shown as user code's failures are.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

from rltrain.config import VERIFIERS as PREFIX

# verifiers imports a harness by a top-level module name and takes the class that module exports
# in __all__: this module, under that name
HARNESS = "rltrain_gateway_harness"
sys.modules.setdefault(HARNESS, sys.modules[__name__])

__all__ = ["GatewayHarness"]


class GatewayHarness(vf.Harness[vf.HarnessConfig]):
    """A chat loop in this process: the conversation to the model through the interception
    ``endpoint``, each tool call to the task's MCP servers, until a reply calls no tool."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def setup(self, runtime) -> None:
        """Nothing to install: the loop runs here."""

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        servers = {name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()}
        async with contextlib.AsyncExitStack() as stack:
            tools, dispatch, connections = (
                await connect_mcp({"mcpServers": servers}, stack) if servers else ([], {}, {})
            )
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=None))
            while True:
                body = {"model": ctx.model, "messages": messages, **({"tools": tools} if tools else {})}
                response = await client.post(
                    f"{endpoint}/chat/completions", json=body, headers={"Authorization": f"Bearer {secret}"}
                )
                if response.status_code != 200:
                    if trace.stop_condition is not None:  # the interception stopped the episode (max turns)
                        return vf.ProgramResult(0, "", "")
                    return vf.ProgramResult(1, "", f"HTTP {response.status_code}: {response.text[:2000]}")
                message = response.json()["choices"][0]["message"]
                messages.append(message)
                if not message.get("tool_calls"):
                    return vf.ProgramResult(0, "", "")
                for call in message["tool_calls"]:
                    messages.append(await _tool_message(call, dispatch, connections))


async def _tool_message(call: dict, dispatch: dict, connections: dict) -> dict:
    name = call["function"]["name"]
    try:
        arguments = json.loads(call["function"].get("arguments") or "{}")
    except json.JSONDecodeError as e:
        content: Any = f"error: invalid JSON in tool arguments ({e})"
    else:
        if name not in dispatch:
            content = f"error: unknown tool {name!r}"
        elif not isinstance(arguments, dict):
            content = f"error: tool arguments must be a JSON object, got {type(arguments).__name__}"
        else:
            content = await call_mcp(connections, dispatch, name, arguments)
    return {"role": "tool", "tool_call_id": call.get("id", ""), "name": name, "content": content}


def env_config(name: str, kwargs: dict[str, Any], max_turns: int):
    """The verifiers env config of ``env.name``/``env.kwargs``: the taskset, and one agent that
    is this module's harness in the subprocess runtime (local: the harness runs no program)."""
    return vf.resolve_env_config({
        "taskset": {**kwargs, "id": name[len(PREFIX):]},
        "agent": {"harness": {"id": HARNESS}, "runtime": {"type": "subprocess"}, "max_turns": max_turns},
        "interception": {"type": "server"},
    })  # fmt: skip


def load_env(name: str, kwargs: dict[str, Any], max_turns: int):
    return vf.load_environment(env_config(name, kwargs, max_turns))


def task_rows(env, size: int) -> list[dict[str, Any]]:
    """A loaded environment's tasks as rows (at most ``size``, for a taskset without end): ``task``
    (its index in ``load()`` order), ``key`` (its content's hash), ``prompt`` (as text, for the
    rollouts on disk) and an empty ``answer`` (the task scores itself)."""
    rows = []
    for i, task in enumerate(env.taskset):
        if i == size:
            break
        prompt = task.data.prompt
        text = prompt if isinstance(prompt, str) else str([message_to_wire(m) for m in prompt or []])
        rows.append({"prompt": text, "answer": "", "task": i, "key": task.key})
    return rows


# the request header that carries an episode's key to the gateway (verifiers reads an endpoint's
# API key from a process-wide environment variable, which every subprocess and MCP runtime started
# meanwhile would inherit, every concurrent episode's key with it; a header stays in its client)
KEY_HEADER = "X-Rltrain-Key"
NO_KEY_VAR = "RLTRAIN_VERIFIERS_NO_KEY"  # never set: the bearer verifiers sends is a stand-in


class VerifiersEpisodes:
    """A generator's verifiers environment: :meth:`serving` around a rollout's episodes (verifiers'
    interception server and the taskset's shared tool servers), and :meth:`run`, one episode, the
    agent function of the gateway's :class:`~rltrain.episodes.agents.AgentRunner`. The taskset is
    read lazily, as far as the rows the run asks for (a taskset may have no end)."""

    def __init__(self, name: str, kwargs: dict[str, Any], max_turns: int):
        self.env = load_env(name, kwargs, max_turns)
        self._unread = iter(self.env.taskset)
        self.tasks: list = []

    def task(self, index: int):
        """The taskset's ``index``-th task in ``load()`` order, read up to it."""
        while len(self.tasks) <= index:
            try:
                self.tasks.append(next(self._unread))
            except StopIteration:
                raise RuntimeError(f"the taskset has {len(self.tasks)} tasks, not task {index}") from None
        return self.tasks[index]

    def serving(self):
        return self.env.serving()

    async def run(
        self, row: dict, base_url: str, api_key: str, model: str
    ) -> tuple[float, dict[str, float], bool]:
        """One episode of the row's task against ``base_url``: the trace's reward, by name its
        reward functions' scores (``reward/<name>``) and its metrics, and whether verifiers cut it
        (``env.max_turns``, a token limit, a reply cut at its length); a verifiers error raises."""
        task = self.task(row["task"])
        if task.key != row["key"]:
            raise RuntimeError(f"task {row['task']} of the taskset is not the one the run's rows hold "
                               "(its load() order changed between the driver and this generator)")  # fmt: skip
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=NO_KEY_VAR, headers={KEY_HEADER: api_key})
        [slot] = self.env.slots(task)
        episode = await self.env.run_slot(slot, vf.ModelContext(model=model, client=client))
        errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
        if errors or not episode.traces:
            first = errors[0] if errors else None
            detail = (first.traceback or f"{first.type}: {first.message}") if first else "no trace"
            raise RuntimeError(f"verifiers ended the episode with an error:\n{detail}")
        trace = episode.traces[0]
        scores = {f"reward/{k}": r.score for k, r in trace.rewards.items() if r is not None}
        metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
        return float(trace.reward), {**scores, **metrics}, trace.is_truncated
