"""Calling Ray actors so that a dead or silent one is noticed at once and named.

:func:`gather` is ``ray.get`` for the calls of one step on several actors: it returns as soon as
an actor's process dies (not when its peers, blocked in a collective with it, give up), and
raises :class:`ActorFailure` naming the actor and the cause. A call that takes longer than the
step timeout fails the same way. Exceptions raised *inside* an actor's method (a bug, a bad
batch) are not failures of the actor and propagate unchanged, unless a peer died at the same
time (then the peer is the cause).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

PEER_GRACE_S = 5.0  # after a method raised, how long to look for a peer that died


# what an actor's start-up raises that a restart raises again: the settings, the model or the
# code are wrong (a dead process, a lost node, a collective a peer left raise other kinds)
RECURRING = ("ValueError", "TypeError", "KeyError", "AttributeError", "NotImplementedError", "ImportError",
             "ModuleNotFoundError", "AssertionError", "FileNotFoundError", "IndexError", "ValidationError",
             "ConfigError", "LookupError", "NameError")  # fmt: skip


class ActorFailure(RuntimeError):
    """An actor died or stopped answering; the run can restart from its newest checkpoint, unless
    its start-up raised what a restart raises again (:attr:`recurs`)."""

    def __init__(self, actor: str, cause: str, timed_out: bool = False):
        super().__init__(f"{actor} {cause}")
        self.actor, self.cause, self.timed_out = actor, cause, timed_out
        self.stacks: Path | None = None  # where every actor's stacks were written (a time-out)

    @property
    def recurs(self) -> bool:
        """Its start-up raised an error of a kind that a restart raises again (:data:`RECURRING`)."""
        raised = re.search(r"its start-up raised (?:\w+\.)*(\w+): ", self.cause)
        return raised is not None and raised.group(1).endswith(RECURRING)


class StartupTimeout(RuntimeError):
    """Ray could not place a group of actors within ``run.startup_timeout_s``; says what was asked
    and what the cluster has."""


def wait_placed(group, what: str, bundles: list[dict], strategy: str, timeout_s: float) -> None:
    """Wait for the placement group ``group`` (``bundles`` under ``strategy``) for ``what``; past
    ``timeout_s`` raise :class:`StartupTimeout` (the caller removes the group)."""
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        per_node = "; ".join(_resources(n) for n in nodes)
        raise StartupTimeout(
            f"{what}: Ray could not place {len(bundles)} x {_resources(bundles[0])} ({strategy}) within "
            f"run.startup_timeout_s={timeout_s:g}s; the cluster has {len(nodes)} node(s) ({per_node}), "
            f"free now: {_resources(ray.available_resources())}"
        ) from None


def _resources(resources: dict) -> str:
    shown = {k: v for k, v in resources.items() if k in ("CPU", "GPU") and v}
    return ", ".join(f"{v:g} {k}" for k, v in shown.items()) or "nothing"


def gather(refs: Sequence[ray.ObjectRef], names: Sequence[str], timeout_s: float | None = None) -> list[Any]:
    """The results of ``refs`` (one call on the actor ``names[i]`` each), in order."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending, results = list(refs), {}
    index = {ref: i for i, ref in enumerate(refs)}
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:  # every actor still pending is named (one hung, its peers wait in a collective)
            silent = ", ".join(names[index[ref]] for ref in pending)
            consumed(pending)
            raise ActorFailure(silent, f"did not answer within run.actor_timeout_s={timeout_s:g}s", True)
        for ref in ready:
            try:
                results[index[ref]] = ray.get(ref)
            except RayTaskError as error:
                raise_dead_peer(pending, index, names)
                consumed(pending)
                raise error
            except (RayActorError, ActorUnavailableError) as error:
                consumed(pending)
                raise ActorFailure(names[index[ref]], describe(error)) from error
    return [results[i] for i in range(len(refs))]


def consumed(refs: Sequence[ray.ObjectRef]) -> None:
    """The calls still pending when one of their group failed, awaited on a thread and their
    outcomes dropped: the failure is told once, by whoever raised it, and a peer's own error (its
    collective broken a moment later) is not printed by Ray after it as an unhandled one."""

    def drain():
        for ref in refs:
            with contextlib.suppress(Exception):
                ray.get(ref)

    if refs:
        threading.Thread(target=drain, daemon=True, name="consumed").start()


def _with_reason(line: str, text: str) -> str:
    """An exception's line, and for pydantic's ("1 validation error for VllmConfig") the error's own
    line that follows it (the reason)."""
    if not re.search(r"\d+ validation errors? for \w+$", line):
        return line
    after = text[text.index(line) + len(line) :].strip().splitlines()
    reason = next((ln.strip() for ln in after if ln.strip() and not ln.strip().startswith("For further")), "")
    reason = reason.split(" [type=")[0]  # (pydantic's error type and the input it read)
    return f"{line}: {reason}" if reason else line


def raise_dead_peer(pending: list, index: dict, names: Sequence[str]) -> None:
    """A method raised: when a peer died meanwhile (a collective with it broke), that is the cause."""
    deadline = time.monotonic() + PEER_GRACE_S
    while pending and time.monotonic() < deadline:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in ready:
            try:
                ray.get(ref)
            except (RayActorError, ActorUnavailableError) as error:
                consumed(pending)
                raise ActorFailure(names[index[ref]], describe(error)) from error
            except (RayTaskError, GetTimeoutError):
                pass


def describe(error: Exception) -> str:
    """Ray's many-line actor error as a short cause: how the process ended, and its pid."""
    text = str(error)
    pid = re.search(r"\bpid: (\d+)", text)
    detail = re.search(r"Worker exit detail: (.+?\.)(?:\s|$)", text)
    cause = "died" if isinstance(error, RayActorError) else "is unavailable"
    raised = re.findall(r"^\s*((?:\w+\.)*\w*(?:Error|Exception): .+)$", text, re.MULTILINE)
    if "creation task" in text and raised:  # its __init__ raised: the exception's line says why
        cause += f" (its start-up raised {_with_reason(raised[-1].strip(), text)})"
    elif detail:
        cause += f" ({detail.group(1).rstrip('.')})"
    elif "OOM" in text or "out of memory" in text.lower():
        cause += " (out of memory)"
    return cause + (f", pid {pid.group(1)}" if pid else "")


def node_address() -> tuple[str, int]:
    """This node's address and a port free on it (a process group's rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def where() -> dict[str, Any]:
    """Where the calling actor runs (for the run folder's placement.json)."""
    context = ray.get_runtime_context()
    return {"node_id": context.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


def write_stacks(places: list[dict[str, Any]], path: Path, timeout_s: float = 30.0) -> Path:
    """Every actor's Python stacks (``py-spy dump``, what ``ray stack`` runs) into ``path``, one
    section per actor of ``places`` (placement.json's entries); an actor on another node, or one
    py-spy cannot read, gets a line saying why."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    here = ray.util.get_node_ip_address()
    sections = []
    for place in places:
        head = f"=== {place['actor']} (pid {place['pid']}, {place['ip']})"
        if place["ip"] != here:
            sections.append(f"{head}\non another node: run `ray stack` there\n")
            continue
        try:
            done = subprocess.run([py_spy, "dump", "--pid", str(place["pid"])], capture_output=True,
                                  text=True, timeout=timeout_s)  # fmt: skip
            sections.append(f"{head}\n{done.stdout or done.stderr}")
        except (OSError, subprocess.TimeoutExpired) as e:
            sections.append(f"{head}\npy-spy failed: {e}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(sections))
    return path
