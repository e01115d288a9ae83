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

Where every member runs on one node (``shm``, gloo's group), the buckets do not travel through the
group at all: the sender writes them into two bucket-sized slots of shared memory (``/dev/shm``)
in turn, and the group carries only the signals, "bucket k is written" (a broadcast of one number)
and "every receiver has read bucket k" (an all-reduce of one), so a slot is written again only
once every receiver has copied it out. (Out, not read in place: a consumer may keep what it is
given, as vLLM's in-place reload keeps a layer's tensors until the layer is whole. A receiver's
thread copies the next bucket while the engine loads this one.)
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

ALIGN = 16  # bytes: every tensor starts at a multiple, so a byte buffer views as any dtype


def state_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What a sync sends of ``model``: every parameter (a shared one under each of its names) and
    every persistent buffer (a router's score-correction bias), by its state-dict name, as the
    model's checkpoint holds them."""
    yield from model.named_parameters(remove_duplicate=False)
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield f"{prefix}.{name}" if prefix else name, buffer


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
    def largest_bucket(self) -> int:
        """Bytes of the largest bucket (a tensor larger than the bucket size makes its own)."""
        return max((_places(bucket)[1] for bucket in self.buckets), default=0)

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


class SharedSlots:
    """The two bucket slots of a same-node weight group: files in ``/dev/shm`` that rank 0 creates
    before the group forms and every member opens once it has formed; rank 0 then removes them
    (:meth:`unlink`), so nothing is left behind, whenever and however a member ends. Each member
    maps the open files (``/proc/self/fd/N``), each mapping made once."""

    def __init__(self, name: str, create: bool, slots: int = 2, folder: str = "/dev/shm"):
        self.paths = [os.path.join(folder, f"{name}-{i}") for i in range(slots)]
        self.owner = create
        self.fds = [os.open(path, os.O_RDWR | os.O_CREAT, 0o600) for path in self.paths] if create else []
        self._maps: dict[tuple[int, int], torch.Tensor] = {}

    def open(self) -> None:
        """A member other than rank 0: hold the files open (rank 0 removes them next)."""
        self.fds = self.fds or [os.open(path, os.O_RDWR) for path in self.paths]

    def slot(self, index: int, size: int) -> torch.Tensor:
        """Slot ``index % slots`` as ``size`` bytes (rank 0 grows its file first)."""
        fd = self.fds[index % len(self.fds)]
        key = (index % len(self.fds), size)
        if key not in self._maps:
            if self.owner and os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)
            self._maps[key] = torch.from_file(
                f"/proc/self/fd/{fd}", shared=True, size=size, dtype=torch.uint8
            )
        return self._maps[key]

    def unlink(self) -> None:
        """Remove the files (the open ones and their mappings stay); rank 0, once every member holds
        them open."""
        if self.owner:
            for path in self.paths:
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def __del__(self) -> None:
        self.unlink()
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass
class WeightGroup:
    """One member of the weight group: the process group, the store it was made from (kept alive
    with it), where its buckets live (the GPU for NCCL, host memory for gloo), and on one node the
    shared slots the buckets go through instead."""

    group: Any
    store: Any
    device: torch.device
    slots: SharedSlots | None = None

    def all_reduce(self, value: torch.Tensor):
        """Start summing ``value`` over the group (a receiver's "done"); ``.wait()`` the result."""
        return self.group.allreduce([value])

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
    ``world_size`` members have joined, or raises after ``timeout_s``. ``backend``: ``nccl``,
    ``gloo``, or ``shm`` (gloo for the signals, the buckets through shared memory: one node)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    # (rank 0 creates the slots before the group forms: a member that has joined finds them)
    slots = SharedSlots(f"rltrain-weights-{port}", create=rank == 0) if backend == "shm" else None
    store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=timeout)
    store = dist.PrefixStore("rltrain-weights", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        device = torch.device("cuda", torch.cuda.current_device())
        return WeightGroup(dist.ProcessGroupNCCL(store, rank, world_size, options), store, device)
    group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if slots is not None:
        slots.open()
        group.allreduce([torch.zeros(1)]).wait()  # every member holds the files open
        slots.unlink()
    return WeightGroup(group, store, torch.device("cpu"), slots)


def shared_memory_free(folder: str = "/dev/shm") -> int:
    """Bytes free in ``folder`` on this node (0 where there is none)."""
    try:
        stats = os.statvfs(folder)
    except OSError:
        return 0
    return stats.f_bavail * stats.f_frsize


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
    if group.slots is not None:
        return _send_shared(group, layout, tensors)
    sent, in_flight = 0, None
    for bucket in layout.buckets:
        offsets, size = _places(bucket)
        buffer = torch.empty(size, dtype=torch.uint8, device=group.device)
        _fill(buffer, bucket, offsets, tensors)
        if in_flight is not None:
            in_flight.wait()  # (its buffer goes with it)
        in_flight = group.broadcast(buffer)
        sent += size
    if in_flight is not None:
        in_flight.wait()
    return sent


def _fill(buffer: torch.Tensor, bucket: list[TensorMeta], offsets: list[int], tensors: Iterator) -> None:
    """Copy the next tensors of ``tensors`` into the bucket's places, checking names and shapes."""
    for meta, view in zip(bucket, _views(buffer, bucket, offsets)):
        name, tensor = next(tensors)
        if name != meta.name or tuple(tensor.shape) != tuple(meta.shape):
            raise RuntimeError(f"weight sync: sent {name} {tuple(tensor.shape)}, the layout has "
                               f"{meta.name} {tuple(meta.shape)}")  # fmt: skip
        view.copy_(tensor.detach())


def _send_shared(group: WeightGroup, layout: Layout, tensors: Iterator[tuple[str, torch.Tensor]]) -> int:
    """:func:`send` through the shared slots. The signals go in the order every receiver posts
    them too (:func:`_receive_shared`): written 0, written 1, read 0, written 2, read 1, ..."""
    slots, largest = group.slots, layout.largest_bucket
    sent, read, written = 0, [], []
    for k, bucket in enumerate(layout.buckets):
        if k >= len(slots.paths):
            read[k - len(slots.paths)].wait()  # every receiver is done with the slot
        offsets, size = _places(bucket)
        _fill(slots.slot(k, largest)[:size], bucket, offsets, tensors)
        written.append(group.broadcast(torch.tensor([k])))
        if k >= 1:
            read.append(group.all_reduce(torch.zeros(1)))  # bucket k - 1
        sent += size
    read.append(group.all_reduce(torch.zeros(1)))
    for work in [*written, *read]:
        work.wait()
    return sent


def receive(group: WeightGroup, layout: Layout, ahead: int = 2) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver: every tensor of the layout by name (an alias right after its tensor), views of
    the buckets, each bucket's as soon as it has arrived; ``ahead`` buckets are posted before the one
    being read, so a consumer that loads them as they come (an engine's in-place reload) overlaps
    the transfer. Every bucket must be read (the broadcasts are collective)."""
    aliases: dict[str, list[str]] = {}
    for alias, name in layout.aliases.items():
        aliases.setdefault(name, []).append(alias)
    if group.slots is not None:
        return _receive_shared(group, layout, aliases)
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


def _receive_shared(
    group: WeightGroup, layout: Layout, aliases: dict[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`receive` through the shared slots. A thread copies bucket k out of its slot once
    "written k" has come, says "read k" and hands the copy over, one bucket ahead of the consumer:
    the copy of the next bucket overlaps the loading of this one."""
    slots, largest = group.slots, layout.largest_bucket
    copies: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()  # the consumer stopped (done, or early): the thread ends too

    def hand_over(item) -> bool:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                copies.put(item, timeout=0.05)
                return True
        return False

    def copy_out() -> None:
        try:
            written = [
                group.broadcast(torch.zeros(1, dtype=torch.int64)) for _ in layout.buckets[: len(slots.paths)]
            ]
            for k, bucket in enumerate(layout.buckets):
                written[k].wait()
                copy = slots.slot(k, largest)[: _places(bucket)[1]].clone()
                read = group.all_reduce(torch.zeros(1))
                if k + len(slots.paths) < len(layout.buckets):
                    written.append(group.broadcast(torch.zeros(1, dtype=torch.int64)))
                read.wait()
                if not hand_over(copy):
                    return
        except BaseException as e:  # noqa: BLE001  (raised where the weights are read)
            hand_over(e)

    thread = threading.Thread(target=copy_out, name="weight-copy", daemon=True)
    thread.start()
    try:
        for bucket in layout.buckets:
            copy = copies.get()
            if isinstance(copy, BaseException):
                raise copy
            for meta, view in zip(bucket, _views(copy, bucket, _places(bucket)[0])):
                yield meta.name, view
                for alias in aliases.get(meta.name, ()):
                    yield alias, view
    finally:  # (a consumer that stopped early: the thread hands nothing more over and ends)
        stop.set()
        thread.join()


def on_host(arriving: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What :func:`receive` yields, kept for later (an engine with rollouts in flight): each tensor
    copied to host memory as it arrives where it came on a GPU, so every bucket's device buffer is
    freed once its tensors are copied, not held as a whole extra copy of the model (an alias shares
    its tensor's copy); host tensors are kept as they are."""
    kept: dict[str, torch.Tensor] = {}
    source = copy = None  # the last tensor and its copy (an alias comes right after its tensor)
    for name, tensor in arriving:
        if tensor.device.type != "cpu":
            if tensor is not source:
                source, copy = tensor, tensor.to("cpu")
            tensor = copy
        kept[name] = tensor
    return kept


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
