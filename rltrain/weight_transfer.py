"""Weights over a collective: learner rank 0 and every generator in one process group of their own
(rank 0 the sender), the weights broadcast in buckets. Pure torch: the learners and the generators
call it, the driver (:mod:`rltrain.run.weight_sync`) only tells them when.

The group is made from a ``TCPStore`` that rank 0 hosts, outside torch.distributed's default group
(which the learners use among themselves): gloo with the buckets in host memory, or NCCL with the
buckets on the GPU where the sender and every receiver hold a GPU of their own. Every operation
has a time limit, so a peer that is gone or stuck fails the sync instead of hanging it.

A bucket is a flat byte buffer that the tensors of a stretch of the model fill one after another
(any dtype); a tensor larger than a bucket goes alone. The sender gathers and copies one bucket
while the one before it is on its way, so the memory the sync takes on the sender is two buckets at
most, not the model.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

ALIGN = 16  # bytes: every tensor starts at a multiple, so a byte buffer views as any dtype


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Layout:
    """What one sync sends: the tensors in order, cut into buckets; ``aliases`` are names that
    load the tensor of another name (a tied output head), sent once."""

    buckets: list[list[TensorMeta]]
    aliases: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(meta.nbytes for bucket in self.buckets for meta in bucket)

    @property
    def names(self) -> list[str]:
        """Every name a sync loads: each tensor's, and the aliases."""
        return [meta.name for bucket in self.buckets for meta in bucket] + list(self.aliases)


def plan_buckets(
    metas: Iterable[TensorMeta], bucket_bytes: int, aliases: dict[str, str] | None = None
) -> Layout:
    """The tensors in their order, a new bucket whenever the next one would pass ``bucket_bytes``."""
    buckets: list[list[TensorMeta]] = []
    size = 0
    for meta in metas:
        if not buckets or (buckets[-1] and size + meta.nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(meta)
        size += meta.nbytes
    return Layout(buckets, dict(aliases or {}))


@dataclass
class WeightGroup:
    """One member of the weight group: the process group, the store it was made from (kept alive
    with it), and where its buckets live (the GPU for NCCL, host memory for gloo)."""

    group: Any
    store: Any
    device: torch.device

    def broadcast(self, buffer: torch.Tensor):
        """Start broadcasting ``buffer`` from rank 0 (into it, elsewhere); ``.wait()`` the result.
        The group carries its broadcasts in the order they were started."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.group.broadcast([buffer], options)


def open_group(
    address: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float
) -> WeightGroup:
    """This process's member of the weight group (rank 0 hosts the store); returns when all
    ``world_size`` members have joined, or raises after ``timeout_s``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore("rltrain-weights", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        device = torch.device("cuda", torch.cuda.current_device())
        return WeightGroup(dist.ProcessGroupNCCL(store, rank, world_size, options), store, device)
    return WeightGroup(dist.ProcessGroupGloo(store, rank, world_size, timeout), store, torch.device("cpu"))


def device_key() -> str | None:
    """The GPU this process computes on (its UUID), or None on CPU: NCCL needs one GPU per member."""
    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def send(group: WeightGroup, layout: Layout, tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
    """Rank 0: broadcast ``tensors`` (by the layout's order and names, each taken from the iterator
    just before it is copied, so a gathered parameter can be let go at once) bucket by bucket, each
    bucket filled while the one before it is on its way (two at most at once). Returns the bytes
    sent."""
    sent, in_flight = 0, None
    for bucket in layout.buckets:
        offsets, size = _places(bucket)
        buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
        for meta, view in zip(bucket, _views(buffer, bucket, offsets)):
            name, tensor = next(tensors)
            if name != meta.name or tuple(tensor.shape) != tuple(meta.shape):
                raise RuntimeError(f"weight sync: sent {name} {tuple(tensor.shape)}, the layout has "
                                   f"{meta.name} {tuple(meta.shape)}")  # fmt: skip
            view.copy_(tensor.detach())
        if in_flight is not None:
            in_flight.wait()  # (its buffer goes with it)
        in_flight = group.broadcast(buffer)
        sent += size
    if in_flight is not None:
        in_flight.wait()
    return sent


def receive(group: WeightGroup, layout: Layout, ahead: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver: every tensor of the layout by name (an alias right after its tensor), views of
    the buckets, each bucket's as soon as it has arrived; ``ahead`` buckets are posted before the one
    being read, so a consumer that loads them as they come (an engine's in-place reload) overlaps
    the transfer. Every bucket must be read (the broadcasts are collective)."""
    aliases: dict[str, list[str]] = {}
    for alias, name in layout.aliases.items():
        aliases.setdefault(name, []).append(alias)
    posted: list[tuple[list[TensorMeta], torch.Tensor, list[int], Any]] = []

    def post(index: int) -> None:
        if index < len(layout.buckets):
            bucket = layout.buckets[index]
            offsets, size = _places(bucket)
            buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
            posted.append((bucket, buffer, offsets, group.broadcast(buffer)))

    for index in range(ahead + 1):
        post(index)

    def arriving() -> Iterator[tuple[str, torch.Tensor]]:
        for index in range(len(layout.buckets)):
            bucket, buffer, offsets, work = posted[index]
            posted[index] = None  # (the views keep the buffer as long as they are used)
            work.wait()
            post(index + ahead + 1)
            for meta, view in zip(bucket, _views(buffer, bucket, offsets)):
                yield meta.name, view
                for alias in aliases.get(meta.name, ()):
                    yield alias, view

    return arriving()


def _places(bucket: list[TensorMeta]) -> tuple[list[int], int]:
    """Each tensor's byte offset in its bucket (aligned for any dtype) and the bucket's size."""
    offsets, end = [], 0
    for meta in bucket:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + meta.nbytes
    return offsets, end


def _views(buffer: torch.Tensor, bucket: list[TensorMeta], offsets: list[int]) -> Iterator[torch.Tensor]:
    for meta, start in zip(bucket, offsets):
        yield buffer[start : start + meta.nbytes].view(meta.dtype).view(meta.shape)
