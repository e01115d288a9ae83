"""The SDK's futures: most calls answer a request id at once, and the client long-polls
``retrieve_future`` for the result. A result is a JSON object, protobuf bytes (the results of
``forward_backward`` and ``asample``) or a failure ``{"error", "category"}`` (``user``: the caller's
mistake, refused for that request alone; ``server``: ours). A poll is held until the result is
there or ``poll_s`` passes, then answered "try again" (HTTP 408, which the SDK polls again on)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from rltrain.serve.wire import BadRequest


@dataclass
class Result:
    """One request's outcome: ``json`` (a response object), ``proto`` (protobuf bytes), or a failure."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"

    def failure(self) -> dict | None:
        return None if self.error is None else {"error": self.error, "category": self.category}


def outcome(call: Callable[[], Result]) -> Result:
    """``call()``'s result, or its failure: a :class:`BadRequest` as the caller's (``user``), any
    other exception as the server's (which goes on serving)."""
    try:
        return call()
    except BadRequest as e:
        return Result(error=str(e), category="user")
    except Exception as e:
        return Result(error=f"{type(e).__name__}: {e}", category="server")


class Futures:
    """Request ids and their results, written by worker threads and read by the server's loop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._done: dict[str, Result] = {}
        self._pending: set[str] = set()
        self._ids = itertools.count(1)

    def new(self) -> str:
        with self._lock:
            request_id = f"req-{next(self._ids)}"
            self._pending.add(request_id)
        return request_id

    def resolve(self, request_id: str, result: Result) -> None:
        with self._lock:
            self._pending.discard(request_id)
            self._done[request_id] = result

    def known(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pending or request_id in self._done

    async def wait(self, request_id: str, seconds: float) -> Result | None:
        """The result, once there within ``seconds``; None: still pending (try again)."""
        deadline = time.monotonic() + seconds
        while True:
            with self._lock:
                result = self._done.get(request_id)
            if result is not None or time.monotonic() >= deadline:
                return result
            await asyncio.sleep(0.01)
