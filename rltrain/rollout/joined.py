"""Continuous batching for calls on several threads (the Tinker server's sample requests): each
call's requests join one vLLM engine's batch in progress at its next step, as vLLM's own server
batches, instead of waiting for the requests before them. The call that finds the engine idle steps
it for every call; the others wait for their own requests' outputs."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Call:
    """One call: its requests ``(engine prompt, SamplingParams)``, the adapter they sample through
    (a LoRARequest, if any), each one's output once finished (or the error that failed them), and
    the event its thread waits on."""

    requests: list[tuple[dict, Any]]
    lora: Any = None
    outputs: dict[int, Any] = field(default_factory=dict)
    error: Exception | None = None
    finished: threading.Event = field(default_factory=threading.Event)

    def fail(self, error: Exception) -> None:
        self.error = error
        self.finished.set()


class JoinedBatch:
    """An engine (vLLM's ``LLMEngine``) that calls on several threads share, step by step; ``lock``
    is held for each step and every addition (the engine's other users hold it too)."""

    def __init__(self, engine, lock: threading.RLock, before_step: Callable[[], None] = lambda: None):
        self.engine, self.lock, self.before_step = engine, lock, before_step
        self._ids = itertools.count()
        self._running: dict[str, tuple[_Call, int]] = {}  # request id -> its call, its index there
        self._arrivals: list[_Call] = []  # calls not in the engine yet
        self._arrival_lock = threading.Lock()
        self._stepping = False  # a call steps the engine for every call

    def run(self, requests: list[tuple[dict, Any]], lora=None) -> list[Any]:
        """Each request's final ``RequestOutput`` (``params.output_kind`` must be ``FINAL_ONLY``),
        the requests run beside every other call's. A request vLLM refuses fails this call alone; a
        step that fails, every call in the engine."""
        if not requests:
            return []
        call = _Call(requests, lora)
        with self._arrival_lock:
            self._arrivals.append(call)
            leads, self._stepping = not self._stepping, True
        if leads:
            self._step_until_empty()
        call.finished.wait()
        if call.error is not None:
            raise call.error
        return [call.outputs[i] for i in range(len(requests))]

    def _step_until_empty(self) -> None:
        """(The call that found no one stepping.) Step the engine until every call's requests are
        finished, adding those that arrive before each step."""
        try:
            self._step_all()
        except BaseException as error:  # (its thread stopped: no call is left waiting on it)
            with self._arrival_lock:
                arrivals, self._arrivals, self._stepping = self._arrivals, [], False
            stopped = RuntimeError(f"the engine's sampling stopped: {error!r}")
            for call in arrivals:
                call.fail(stopped)
            with contextlib.suppress(Exception):
                self._fail_running(stopped)
            raise

    def _step_all(self) -> None:
        while True:
            with self._arrival_lock:
                arrivals, self._arrivals = self._arrivals, []
                if not arrivals and not self._running:
                    self._stepping = False
                    return
            with self.lock:
                try:
                    self.before_step()
                except BaseException:
                    with self._arrival_lock:  # (failed with the rest where the stepping stops)
                        self._arrivals[:0] = arrivals
                    raise
                for call in arrivals:
                    self._add(call)
                if not self._running:
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as error:  # every request in the engine fails with it
                    self._fail_running(error)
                    continue
                for out in outputs:
                    if out.finished and out.request_id in self._running:
                        call, i = self._running.pop(out.request_id)
                        call.outputs[i] = out
                        if len(call.outputs) == len(call.requests):
                            call.finished.set()

    def _fail_running(self, error: Exception) -> None:
        """Every call with requests in the engine fails with ``error``; the requests are aborted."""
        running, self._running = self._running, {}
        for call, _ in running.values():
            call.fail(error)
        self.engine.abort_request(list(running))

    def _add(self, call: _Call) -> None:
        """(Holding the lock.) One call's requests into the engine; one that vLLM refuses fails that call alone."""
        added = []
        try:
            for i, (prompt, params) in enumerate(call.requests):
                request_id = f"joined-{next(self._ids)}"  # (the outputs' name for it)
                self.engine.add_request(request_id, prompt, params, lora_request=call.lora)
                added.append(request_id)
                self._running[request_id] = (call, i)
        except Exception as error:
            self.engine.abort_request(added)
            for request_id in added:
                del self._running[request_id]
            call.fail(error)
