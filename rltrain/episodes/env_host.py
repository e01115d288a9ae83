"""Each episode's environment in its own process, every call with a deadline (no ray).

Environments and their tools are user code: a call may raise, hang or take its process down. A
host process (one per generator, spawned once, the environment's module imported there) forks one
child per episode, which builds the environment and answers that episode's ``reset``, ``step`` and
tool calls. A call past its deadline is stopped by killing that one child, as a hung reward
function's worker is: its episode ends (finish reason ``error``) and the run goes on. Forking from
the single-threaded host is safe and takes milliseconds; the generator itself (vLLM's threads)
never forks.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict
from multiprocessing.connection import Connection, wait
from typing import Any

from rltrain.episodes import tools as builtin_tools
from rltrain.episodes.environments import GYM_HINT, Step, load_environment
from rltrain.episodes.parsers import ToolCall
from rltrain.media import as_content

Call = tuple[int, str, Any, float]  # (episode, method: reset | step | tool, argument, timeout_s)
Answer = tuple[str, Any]  # ("ok", value) | ("raised" | "timeout" | "died", message)


def run_tool(functions: dict[str, Any], call: ToolCall) -> tuple[Any, str | None, str | None]:
    """``(output, error kind or None, traceback or None)``; the output is the tool message's content
    (text, or content parts with images: :func:`rltrain.media.as_content`); a failure's output is
    the error message to the model, a raising tool's traceback is for the user."""
    fn = functions.get(call.name)
    if fn is None:
        return (
            f"error: unknown tool {call.name!r} (tools: {', '.join(functions) or 'none'})",
            "unknown_tool",
            None,
        )
    args, kwargs = ((call.arguments,), {}) if isinstance(call.arguments, str) else ((), call.arguments)
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        return f"error: {call.name}: {e}", "bad_arguments", None
    try:
        return as_content(fn(*args, **kwargs)), None, None
    except Exception as e:
        return f"error: {type(e).__name__}: {e}", "tool_raised", traceback.format_exc()


def _episode(conn, spec: str, kwargs: dict[str, Any]) -> None:
    """A forked child: one environment, its calls in order, until the pipe closes."""
    env = load_environment(spec)(**kwargs)
    functions = {fn.__name__: fn for fn in env.tools}
    while True:
        try:
            method, argument = conn.recv()
        except EOFError:
            return
        try:
            if method == "reset":
                conn.send(("ok", env.reset(argument)))
            elif method == "step":
                step = env.step(argument)
                if not isinstance(step, Step):
                    raise TypeError(f"step returned {type(step).__name__}, not rltrain.envs.Step{GYM_HINT}")
                conn.send(("ok", asdict(step)))
            else:
                conn.send(("ok", run_tool(functions, argument)))
        except Exception:  # the environment's failure ends its episode, never the run
            conn.send(("raised", traceback.format_exc()))


def _host(conn, spec: str, kwargs: dict[str, Any], python_tool: builtin_tools.ToolRunner) -> None:
    """The host's loop: fork a child per opened episode, relay calls, enforce deadlines."""
    builtin_tools.PYTHON = python_tool
    load_environment(spec)  # imported once, inherited by every child
    children: dict[int, tuple[int, Any]] = {}  # episode -> (pid, pipe)
    deadlines: dict[int, float] = {}

    def end(episode: int, kill: bool) -> None:
        pid, pipe = children.pop(episode)
        deadlines.pop(episode, None)
        pipe.close()
        if kill:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    while True:
        timeout = max(0.0, min(deadlines.values()) - time.monotonic()) if deadlines else None
        for ready in wait([conn, *(pipe for _, pipe in children.values())], timeout):
            if ready is conn:
                try:
                    message = conn.recv()
                except EOFError:  # the generator is gone (killed, or it never said stop)
                    message = ("stop",)
                if message[0] == "stop":
                    for episode in list(children):
                        end(episode, kill=True)
                    return
                if message[0] == "open":
                    parent, child = multiprocessing.Pipe()
                    pid = os.fork()
                    if pid == 0:  # the child keeps its own pipe only: the others' ends must close
                        for _, other in children.values():
                            other.close()
                        parent.close()
                        conn.close()
                        _episode(child, spec, kwargs)
                        os._exit(0)
                    child.close()
                    children[message[1]] = (pid, parent)
                elif message[0] == "close":
                    if message[1] in children:
                        end(message[1], kill=False)
                else:  # ("call", episode, method, argument, timeout_s)
                    _, episode, method, argument, timeout_s = message
                    if episode not in children:
                        conn.send((episode, ("died", "the episode's environment was stopped earlier")))
                        continue
                    children[episode][1].send((method, argument))
                    deadlines[episode] = time.monotonic() + timeout_s
                continue
            episode = next(e for e, (_, pipe) in children.items() if pipe is ready)
            try:
                answer = ready.recv()
            except (EOFError, OSError):
                answer = ("died", "the environment's process died")
                end(episode, kill=True)
            else:
                deadlines.pop(episode, None)
            conn.send((episode, answer))
        now = time.monotonic()
        for episode, deadline in list(deadlines.items()):
            if now >= deadline:
                end(episode, kill=True)
                conn.send(
                    (
                        episode,
                        (
                            "timeout",
                            "did not answer in time (env.step_timeout_s or rollout.tools.timeout_s); stopped",
                        ),
                    )
                )


class EnvHost:
    """The generator's side: opens episodes, sends calls in batches, gets every answer back.

    The host is a fresh interpreter (``python -m rltrain.episodes.env_host``) on a socket pair, with
    the caller's ``sys.path``: nothing of the caller's process (threads, its main module) is
    carried over."""

    def __init__(
        self, spec: str, kwargs: dict[str, Any], python_tool: builtin_tools.ToolRunner | None = None
    ):
        env = load_environment(spec)(**kwargs)  # a bad spec or kwargs fail here, in the caller
        self.tools = list(env.tools)
        ours, theirs = socket.socketpair()
        path = os.pathsep.join(p for p in sys.path if p)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rltrain.episodes.env_host", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env={**os.environ, "PYTHONPATH": path},
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((spec, dict(kwargs), python_tool or builtin_tools.PYTHON))
        self._next = 0

    def open(self, count: int) -> list[int]:
        """``count`` new episodes (one process each)."""
        episodes = list(range(self._next, self._next + count))
        self._next += count
        for episode in episodes:
            self.conn.send(("open", episode))
        return episodes

    def call(self, calls: list[Call]) -> list[Answer]:
        """Run calls of different episodes at once; answers in the order of ``calls``. An episode
        that timed out or died is gone: later calls of it answer ``died``."""
        pending: dict[int, Answer | None] = {c[0]: None for c in calls}
        # the calls go out from a thread while this one reads the answers: the host answers as it
        # reads, and once the socket's buffer is full of answers nobody reads, it blocks, and so
        # would a caller that sends everything first (a step of long prompts fills it)
        sending = threading.Thread(target=self._send_calls, args=(calls,), daemon=True)
        sending.start()
        limit = max((c[3] for c in calls), default=0.0) + 30.0
        while any(v is None for v in pending.values()):
            if not self.conn.poll(limit):  # (the sending thread, if stuck, is a daemon)
                raise RuntimeError("the environment host stopped answering")
            episode, answer = self.conn.recv()
            pending[episode] = answer
        sending.join()
        return [pending[c[0]] for c in calls]

    def _send_calls(self, calls: list[Call]) -> None:
        try:
            for episode, method, argument, timeout_s in calls:
                self.conn.send(("call", episode, method, argument, timeout_s))
        except OSError:  # the host is gone: the reading side says so
            pass

    def close(self, episodes: list[int]) -> None:
        for episode in episodes:
            self.conn.send(("close", episode))

    def shutdown(self) -> None:
        try:
            self.conn.send(("stop",))
            self.process.wait(5.0)
        except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
            self.process.kill()
        self.conn.close()


if __name__ == "__main__":
    connection = Connection(int(sys.argv[1]))
    _host(connection, *connection.recv())
