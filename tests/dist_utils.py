"""Helpers for tests that run real torch.distributed processes."""

from __future__ import annotations

import socket

from rltrain.diagnostics import count_collectives

__all__ = ["count_collectives", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
