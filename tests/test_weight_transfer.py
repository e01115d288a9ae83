"""The weight group's transport (rltrain.weight_transfer) between real processes over gloo: what is
sent arrives bit for bit whatever the dtypes and bucket cuts, through the group (gloo) or through
shared memory (shm), and a receiver that is gone or stuck fails the sender instead of hanging it."""

import io
import multiprocessing
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from rltrain.weight_transfer import Layout, TensorMeta, open_group, plan_buckets, receive, send

TIMEOUT_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed": torch.randn(7, 5, generator=g),  # 140 bytes
        "norm": torch.randn(3, generator=g).to(torch.bfloat16),  # 6 bytes: the next tensor is realigned
        "steps": torch.arange(5, dtype=torch.int64),  # 40 bytes
        "big": torch.randn(40, 10, generator=g),  # 1600 bytes: more than a bucket, alone
        "head": torch.randn(2, 2, generator=g).double(),  # 32 bytes
    }


def _layout(bucket_bytes: int = 256) -> Layout:
    metas = [TensorMeta(name, tuple(t.shape), t.dtype) for name, t in _weights().items()]
    return plan_buckets(metas, bucket_bytes, aliases={"lm_head": "embed"})


def _bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Tensors as bytes for the queue: a tensor put there as itself is shared through a file
    descriptor its process must still hold when the test reads it, and the member has exited."""
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


def _member(rank: int, port: int, behaviour: str, results, backend: str) -> None:
    torch.set_num_threads(1)
    try:
        group = open_group("127.0.0.1", port, rank, 3, backend, TIMEOUT_S)
        layout = _layout()
        if rank == 0:
            start = time.monotonic()
            try:
                results.put((0, send(group, layout, iter(_weights().items())), time.monotonic() - start))
            except RuntimeError as e:
                results.put((0, f"error: {e}", time.monotonic() - start))
        elif behaviour == "gone" and rank == 2:
            return  # leaves the group before the sync
        elif behaviour == "quit" and rank == 2:  # stops reading after one tensor (as a load that raised)
            arriving = receive(group, layout)
            next(arriving)
            start = time.monotonic()
            arriving.close()
            alive = [t.name for t in threading.enumerate() if t.name == "weight-copy"]
            results.put((rank, f"copy threads alive: {alive}", time.monotonic() - start))
        elif behaviour == "stuck" and rank == 2:
            time.sleep(3 * TIMEOUT_S)  # alive, never receives
        elif (
            behaviour == "hold"
        ):  # every tensor kept until the last has come (as vLLM's reload keeps a layer's)
            kept = dict(receive(group, layout))
            results.put((rank, _bytes({k: v.clone() for k, v in kept.items()}), 0.0))
        else:  # each copied as it comes
            results.put((rank, _bytes({k: v.clone() for k, v in receive(group, layout)}), 0.0))
    except Exception as e:  # noqa: BLE001  (reported, so the test fails at once, not at its queue's time-out)
        results.put((rank, f"error: {e}", 0.0))


def _run(behaviour: str, backend: str = "gloo") -> dict[int, tuple]:
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_member, args=(rank, port, behaviour, results, backend)) for rank in range(3)]
    for p in procs:
        p.start()
    expected = 2 if behaviour in ("gone", "stuck") else 3
    out = {}
    for _ in range(expected):
        rank, value, seconds = results.get(timeout=60)
        out[rank] = (torch.load(io.BytesIO(value)) if isinstance(value, bytes) else value, seconds)
    for p in procs:
        p.join(timeout=1 if behaviour == "stuck" else 30)
        if p.is_alive():
            p.kill()
    # the shared slots' files go as soon as the group has formed: none is left, even by a member killed
    assert not list(Path("/dev/shm").glob(f"rltrain-weights-{port}-*"))
    return out


def test_buckets_cut_in_order_and_a_tensor_larger_than_a_bucket_goes_alone():
    layout = _layout(bucket_bytes=256)
    # 140 + 6 + 40 = 186 <= 256, + 1600 would pass: cut; big alone; head after it in a new bucket
    assert [[m.name for m in b] for b in layout.buckets] == [["embed", "norm", "steps"], ["big"], ["head"]]
    assert layout.nbytes == 140 + 6 + 40 + 1600 + 32
    assert layout.largest_bucket == 1600  # the shared slots' size: "big", alone, over the 256 asked
    assert layout.aliases == {"lm_head": "embed"}


@pytest.mark.parametrize("backend, behaviour", [("gloo", "ok"), ("shm", "ok"), ("shm", "hold")])
def test_every_receiver_gets_the_weights_bit_for_bit(backend, behaviour):
    out = _run(behaviour, backend)
    sent_bytes = out[0][0]
    # bucket 1: embed at 0 (140 bytes), norm at 144 (the next multiple of 16), steps at 160: 200 bytes
    assert sent_bytes == 200 + 1600 + 32
    for rank in (1, 2):
        got = out[rank][0]
        assert set(got) == {*_weights(), "lm_head"}
        for name, tensor in _weights().items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
        assert torch.equal(got["lm_head"], _weights()["embed"])  # the alias, sent once


@pytest.mark.parametrize("behaviour, backend", [("gone", "gloo"), ("stuck", "gloo"), ("stuck", "shm")])
def test_a_receiver_gone_or_stuck_fails_the_sender_instead_of_hanging_it(behaviour, backend):
    out = _run(behaviour, backend)
    message, seconds = out[0]
    assert isinstance(message, str) and message.startswith("error:"), message
    # gone: the connection closes at once; stuck: the group's time limit (5 s) ends the wait
    assert seconds < 6 * TIMEOUT_S


def test_a_receiver_that_stops_reading_early_leaves_no_thread_behind():
    # its copy thread had the next bucket ready for a consumer that is gone: it ends with the
    # consumer (it blocked forever on its hand-over before); the others fail by the time limit
    out = _run("quit", "shm")
    message, seconds = out[2]
    assert message == "copy threads alive: []" and seconds < TIMEOUT_S
    assert out[0][0].startswith("error:")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_weights_held_for_later_leave_the_gpu_as_they_arrive():
    from rltrain.weight_transfer import on_host

    bucket = torch.arange(8, dtype=torch.float32, device="cuda")  # one received bucket's buffer
    embed = bucket[:4]
    kept = on_host(iter([("embed", embed), ("lm_head", embed), ("norm", bucket[4:])]))
    assert all(t.device.type == "cpu" for t in kept.values())
    assert kept["lm_head"] is kept["embed"]  # an alias shares its tensor's copy
    assert kept["norm"].tolist() == [4.0, 5.0, 6.0, 7.0]
