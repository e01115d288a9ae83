"""`rltrain serve` under a long loop, through the unmodified Tinker SDK: ``--calls`` rounds of
`forward_backward` + `optim_step` + `sample` on one model (a new sampling client every 10 rounds,
so unnamed snapshots come and go), and the resident memory of the server's process and of the Ray
actors (the learners and the engine) along the way: flat after the first 100 rounds is the goal.

    python benchmarks/bench_tinker_memory.py [--calls 1000] [--root DIR]

``--root``: the checkout whose `rltrain serve` runs (another worktree: the figures before a change).
Needs `tinker` (scripts/setup_env.sh installs it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import psutil
from common import model_folder, scratch, serve_tinker, table

ROOT = Path(__file__).resolve().parents[1]


def resident_mib(server_pid: int) -> tuple[float, float]:
    """(the server process's resident MiB, the Ray actors' summed resident MiB)."""
    server = psutil.Process(server_pid).memory_info().rss
    actors = 0
    for proc in psutil.process_iter(["cmdline", "memory_info"]):
        line = " ".join(proc.info["cmdline"] or [])
        if line.startswith(("ray::ServedLearner", "ray::GeneratorActor", "ray::PolicyLearner")):
            actors += proc.info["memory_info"].rss
    return server / 2**20, actors / 2**20


def main() -> None:
    import tinker
    from tinker import types

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose server runs")
    args = parser.parse_args()
    tmp = scratch("bench-tinker-memory-")
    base = model_folder(None, 64, 2)
    proc, url = serve_tinker(args.root.resolve(), tmp / "out", base)
    data = [types.Datum(model_input=types.ModelInput.from_ints(list(range(5 + i, 37 + i))),
                        loss_fn_inputs={"target_tokens": list(range(6 + i, 38 + i)), "weights": [1.0] * 32})
            for i in range(8)]  # fmt: skip
    prompt, params = types.ModelInput.from_ints([5, 6, 7]), types.SamplingParams(max_tokens=8)
    marks = sorted({1, 100, args.calls // 2, args.calls} & set(range(1, args.calls + 1)))
    rows, start = [], time.perf_counter()
    try:
        with tinker.ServiceClient(base_url=url, api_key="tml-bench") as sc:
            tc = sc.create_lora_training_client(base_model=base, rank=4).result()
            sampler = None
            for i in range(1, args.calls + 1):
                tc.forward_backward(data, "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
                if sampler is None or i % 10 == 0:
                    sampler = tc.save_weights_and_get_sampling_client().result()
                sampler.sample(prompt, 2, params).result()
                if i in marks:
                    server, actors = resident_mib(proc.pid)
                    rows.append([i, f"{server:.0f}", f"{actors:.0f}", f"{time.perf_counter() - start:.0f}"])
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"server: {args.root.resolve()}; forward_backward (8 datums of 32 tokens) + optim_step + sample (2 of "
          "8 tokens) a round, a new sampling client every 10; CPU")  # fmt: skip
    print(table(["rounds", "server RSS MiB", "actors RSS MiB (learners + engine)", "elapsed s"], rows))
    if len(rows) > 2:
        grew = [float(rows[-1][c]) - float(rows[1][c]) for c in (1, 2)]
        print(f"after round 100: server {grew[0]:+.0f} MiB, actors {grew[1]:+.0f} MiB")


if __name__ == "__main__":
    main()
