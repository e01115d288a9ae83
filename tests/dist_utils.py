"""Helpers for tests that run real torch.distributed processes."""

from __future__ import annotations

import contextlib
import socket

import torch.distributed as dist

COLLECTIVES = [
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "barrier",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def count_collectives():
    """Count calls of torch.distributed collectives (they still run) while the block executes."""
    calls: dict = {}
    saved = {name: getattr(dist, name) for name in COLLECTIVES}
    for name, real in saved.items():

        def spy(*args, _real=real, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*args, **kwargs)

        setattr(dist, name, spy)
    try:
        yield calls
    finally:
        for name, real in saved.items():
            setattr(dist, name, real)
