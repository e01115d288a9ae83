"""The SDK's futures: most calls answer a request id at once, and the client long-polls
``retrieve_future`` for the result. A result is a JSON object, protobuf bytes (the results of
``forward_backward`` and ``asample``) or a failure ``{"error", "category"}`` (``user``: the caller's
mistake, refused for that request alone; ``server``: ours). A poll is held until the result is
there or ``poll_s`` passes, then answered "try again" (HTTP 408, which the SDK polls again on).
The table is bounded: a retrieved result is freed a minute later (:data:`RETRIEVED_KEPT_S`: a poll
the SDK repeats, its answer lost, is answered again), one nobody retrieves after ``ttl_s``."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from rltrain.serve.wire import BadRequest

# how long a retrieved result stays for a repeated poll
RETRIEVED_KEPT_S = 60.0


@dataclass
class Result:
    """One request's outcome: ``json`` (a response object), ``proto`` (protobuf bytes), or a failure."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"

    def failure(self) -> dict | None:
        return None if self.error is None else {"error": self.error, "category": self.category}


class Fault(RuntimeError):
    """The server's own failure, told in its own sentence (what died, what was restored)."""


def outcome(call: Callable[[], Result]) -> Result:
    """``call()``'s result, or its failure: a :class:`BadRequest` as the caller's (``user``), any
    other exception as the server's (which goes on serving)."""
    try:
        return call()
    except BadRequest as e:
        return Result(error=str(e), category="user")
    except Fault as e:
        return Result(error=str(e), category="server")
    except Exception as e:
        return Result(error=f"{type(e).__name__}: {e}", category="server")


def _wake(woken: asyncio.Future) -> None:
    if not woken.done():
        woken.set_result(None)


class Futures:
    """Request ids and their results, written by worker threads and read by the server's loop;
    ``ttl_s``: how long a result nobody retrieves is kept."""

    def __init__(self, ttl_s: float = 600.0):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._done: dict[str, Result] = {}
        self._pending: set[str] = set()
        self._expiry: dict[str, float] = {}  # request id -> when its result is freed
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}  # held polls
        self._ids = itertools.count(1)

    def new(self) -> str:
        with self._lock:
            request_id = f"req-{next(self._ids)}"
            self._pending.add(request_id)
        return request_id

    def resolve(self, request_id: str, result: Result) -> None:
        with self._lock:
            if request_id not in self._pending:  # (forgotten: nobody will ask)
                return
            self._pending.discard(request_id)
            self._done[request_id] = result
            self._expiry[request_id] = time.monotonic() + self.ttl_s
            waiting = self._waiters.pop(request_id, [])
        for loop, woken in waiting:  # the polls held for it answer now
            loop.call_soon_threadsafe(_wake, woken)

    def forget(self, request_id: str) -> None:
        """A request id nobody was given: no result is kept for it."""
        with self._lock:
            self._pending.discard(request_id)
            self._done.pop(request_id, None)
            self._expiry.pop(request_id, None)

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pending or request_id in self._done

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending) + len(self._done)

    def sweep(self) -> None:
        """Free the results whose time is up (retrieved a minute ago, or never within ``ttl_s``)."""
        now = time.monotonic()
        with self._lock:
            for request_id in [r for r, t in self._expiry.items() if t <= now]:
                del self._expiry[request_id]
                self._done.pop(request_id, None)

    async def wait(self, request_id: str, seconds: float) -> Result | None:
        """The result, once there within ``seconds`` (then freed a minute later); None: still
        pending (try again). The poll wakes when the result is resolved, not on a timer."""
        loop = asyncio.get_running_loop()
        woken = loop.create_future()
        with self._lock:
            held = request_id not in self._done
            if held:
                self._waiters.setdefault(request_id, []).append((loop, woken))
        if held:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woken, seconds)
        with self._lock:
            waiting = self._waiters.get(request_id, [])
            if (loop, woken) in waiting:  # (not woken: the time was up)
                waiting.remove((loop, woken))
                if not waiting:
                    del self._waiters[request_id]
            result = self._done.get(request_id)
            if result is not None:
                self._expiry[request_id] = min(self._expiry[request_id], time.monotonic() + RETRIEVED_KEPT_S)
        return result
