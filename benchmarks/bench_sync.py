"""The weight sync, collective against object store, side by side in one run.

    python benchmarks/bench_sync.py [--steps 3] [--models tiny tiny-256 tiny-512 smollm2] [--zero 2 3]
    python benchmarks/bench_sync.py --transport [--shape 1.5b] [--buckets 64 256 1024]

Trainer mode (the default): one ``python -m rltrain.train`` run per model, ZeRO stage and method
(the collective through shared memory, as it runs on one node; the collective with every bucket
through gloo's TCP, as between nodes; the object store), the demo's layout (2 DeepSpeed learners, 1 vLLM engine) doing plain GRPO with full fine-tuning.
It reports the sync's seconds and bytes (the mean over the steps after the first), the step time
around it, the largest engine-learner log-prob gap (``rollout/mismatch_max``), and the peak resident
memory of learner rank 0 and of the engine, sampled from outside every 20 ms over the whole run
(libraries and the model included: the two methods differ by what the sync holds at once).
The built-in model comes at three sizes (hidden size x layers: 64 x 2, 256 x 4, 512 x 8).

Transport mode needs torch alone (no Ray, DeepSpeed or vLLM): a sender and a receiver process
broadcast a model's worth of bf16 tensors (the shapes of a Qwen2.5 model of ``--shape``) through
:mod:`rltrain.weight_transfer` over gloo, from the sender's GPU where it has one through host
buckets to the receiver's GPU, at each bucket size; beside it the copy of the whole state to host
memory that the object store's path starts with. With two GPUs or more the same over NCCL; with
one, an NCCL group of two processes on it is tried and its error shown (NCCL needs a GPU per member).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import table  # noqa: E402

SHAPES = {  # hidden, intermediate, layers, vocab, kv heads x head dim: Qwen2.5 configs
    "0.5b": (896, 4864, 24, 151936, 128),
    "1.5b": (1536, 8960, 28, 151936, 256),
    "7b": (3584, 18944, 28, 152064, 512),
}


def model_tensors(shape: str, device) -> dict:
    import torch

    hidden, inter, layers, vocab, kv = SHAPES[shape]
    out = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,)}  # fmt: skip
    out["lm_head.weight"] = (vocab, hidden)
    return {name: torch.full(s, 0.5, dtype=torch.bfloat16, device=device) for name, s in out.items()}


class PeakRSS:
    """The largest resident set of processes ``pids`` while it runs, sampled every ``every_s``."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.02):
        import psutil

        self.procs = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.peak = dict.fromkeys(pids, 0)
        self.every_s, self._stop = every_s, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for name, proc in self.procs.items():
                try:
                    self.peak[name] = max(self.peak[name], proc.memory_info().rss)
                except Exception:  # noqa: BLE001  (gone: its peak so far stands)
                    pass
            time.sleep(self.every_s)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------- transport mode (torch only)


def _member(rank: int, world: int, port: int, backend: str, shape: str, buckets_mb: list[float], repeats: int,
            results) -> None:  # fmt: skip
    import torch

    from rltrain import weight_transfer as wt

    try:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(rank % torch.cuda.device_count() if backend == "nccl" else 0)
        device = torch.device("cuda") if cuda else torch.device("cpu")
        group = wt.open_group("127.0.0.1", port, rank, world, backend, 120)
        state = model_tensors(shape, device) if rank == 0 else None
        metas = [wt.TensorMeta(n, tuple(t.shape), t.dtype) for n, t in model_tensors(shape, "meta").items()]
        for mb in buckets_mb:
            layout = wt.plan_buckets(metas, int(mb * 2**20))
            times = []
            for _ in range(repeats):
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                if rank == 0:
                    wt.send(group, layout, iter(state.items()))
                else:  # as an engine loads them: onto its own device
                    for _, tensor in wt.receive(group, layout):
                        tensor.to(device, non_blocking=True)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            results.put((rank, mb, min(times), layout.nbytes))
        if rank == 0:  # what the object store's path starts with: the whole state copied to host memory
            start = time.perf_counter()
            host = {n: t.to("cpu") for n, t in state.items()}
            results.put(
                (rank, "host copy", time.perf_counter() - start, sum(t.nbytes for t in host.values()))
            )
    except Exception as e:  # noqa: BLE001
        results.put((rank, "error", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}", 0))


def transport(shape: str, buckets_mb: list[float], backend: str, repeats: int = 2) -> list[tuple]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_member, args=(r, 2, port, backend, shape, buckets_mb, repeats, results))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    out = []
    while any(p.is_alive() for p in procs) or not results.empty():
        try:
            out.append(results.get(timeout=1))
        except Exception:  # noqa: BLE001  (queue.Empty)
            pass
    return out


def transport_main(args) -> None:
    import torch

    gpus = torch.cuda.device_count()
    print(f"torch {torch.__version__}, {gpus} GPU(s): {torch.cuda.get_device_name(0) if gpus else 'none'}")
    backends = ["gloo", "nccl"] if gpus else ["gloo"]
    for backend in backends:
        rows, host = [], None
        for rank, what, seconds, nbytes in transport(args.shape, args.buckets, backend):
            if what == "error":
                print(f"{backend}, rank {rank}: {seconds}")
            elif what == "host copy":
                host = (seconds, nbytes)
            elif rank == 0:
                rows.append([backend, f"{what:g}", f"{nbytes / 2**30:.2f}", f"{seconds:.3f}",
                             f"{nbytes / seconds / 2**30:.2f}"])  # fmt: skip
        if rows:
            print(table(["backend", "bucket MiB", "GiB sent", "s / sync", "GiB/s"], rows))
        if host:
            print(f"the whole state to host memory alone (the object store's first copy): {host[0]:.3f} s "
                  f"for {host[1] / 2**30:.2f} GiB")  # fmt: skip


# ---------------------------------------------------------------- trainer mode (Ray, DeepSpeed, vLLM)


# what each compared method sets: the collective through shared memory (the default on one node),
# the collective with every bucket through gloo's TCP, and the object store
METHODS = {
    "collective": ["rollout.weight_sync=collective"],
    "collective tcp": ["rollout.weight_sync=collective", "rollout.weight_sync_shared_memory=false"],
    "object_store": ["rollout.weight_sync=object_store"],
}


def trainer_run(model: str, method: str, zero: int, steps: int, out: Path) -> list[object]:
    import json
    import subprocess

    from common import PLAIN_GRPO, REPO

    small = ["algorithm.prompts_per_step=4", "algorithm.group_size=4", "rollout.max_new_tokens=16",
             "learner.micro_batch_size=8", f"learner.zero_stage={zero}"]  # fmt: skip
    cmd = [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", *PLAIN_GRPO,
           f"run.output_dir={out}", f"model.name_or_path={model}", f"run.steps={steps}",
           *METHODS[method], *small]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    placement = out / "placement.json"
    while not placement.exists() and proc.poll() is None:
        time.sleep(0.2)
    pids = {}
    if placement.exists():
        time.sleep(0.5)
        actors = {a["actor"]: a["pid"] for a in json.loads(placement.read_text())}
        pids = {"learner": actors["policy learner 0"], "engine": actors["generator 0"]}
    with PeakRSS(pids) as peaks:
        _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(err[-3000:])
    if "could not be set up" in err:
        print(f"{model}: {method} fell back: {err.strip().splitlines()[-1]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    mean = lambda key: sum(r[key] for r in later) / len(later)  # noqa: E731
    return [method, f"{mean('sync/bytes') / 2**20:.2f}", f"{mean('sync/seconds'):.3f}",
            f"{mean('time/step_s'):.2f}", f"{max(r['rollout/mismatch_max'] for r in rows):.1e}",
            f"{peaks.peak.get('learner', 0) / 2**20:.0f}", f"{peaks.peak.get('engine', 0) / 2**20:.0f}"]  # fmt: skip


BUILTIN_SIZES = {"tiny": (64, 2), "tiny-256": (256, 4), "tiny-512": (512, 8)}  # hidden size, layers


def trainer_main(args) -> None:
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            if name == "smollm2":
                from rltrain.models.pretrained import smollm2_gguf

                model = str(smollm2_gguf())
            else:
                from rltrain.models.tiny import build_tiny_model

                hidden, layers = BUILTIN_SIZES[name]
                model = str(build_tiny_model(Path(scratch) / name, hidden_size=hidden, num_layers=layers))
            for zero in args.zero:
                for method in METHODS:
                    out = Path(scratch) / f"{name}-{zero}-{method.replace(' ', '-')}"
                    os.makedirs(out, exist_ok=True)
                    results.append([name, zero, *trainer_run(model, method, zero, args.steps, out)])
                    print(results[-1], flush=True)
    print(table(["model", "ZeRO", "sync", "MiB", "s / sync", "s / step", "mismatch max", "learner 0 peak MiB",
                 "engine peak MiB"], results))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--transport", action="store_true")
    parser.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    parser.add_argument("--buckets", type=float, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--zero", type=int, nargs="+", default=[2, 3], help="the learners' ZeRO stages")
    parser.add_argument(
        "--models", nargs="+", default=[*BUILTIN_SIZES, "smollm2"], choices=[*BUILTIN_SIZES, "smollm2"]
    )
    args = parser.parse_args()
    transport_main(args) if args.transport else trainer_main(args)


if __name__ == "__main__":
    main()
