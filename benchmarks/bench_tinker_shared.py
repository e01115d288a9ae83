"""`rltrain serve` with several LoRA models of one base at once, through the unmodified Tinker SDK:
the models on one shared set of learners (`serve.models_per_learners=8`, the default) against each
on learners of its own (`serve.models_per_learners=1`). For each: how long each `create_model`
takes, the learner processes and their resident memory once every model is live, and a round of
`forward_backward` (8 datums of 32 tokens) + `optim_step` on every model, sent all at once.

    python benchmarks/bench_tinker_shared.py [--models 4] [--rounds 5]

The two servers run one after the other on the same machine; each round's seconds are shown as the
median and range. Needs `tinker` (scripts/setup_env.sh installs it).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import model_folder, scratch, serve_tinker, table

ROOT = Path(__file__).resolve().parents[1]
KEY = "tml-bench"


def learner_processes() -> tuple[int, float]:
    """The served learners' processes on this machine and their resident memory, MiB."""
    import psutil

    rss = [p.memory_info().rss for p in psutil.process_iter(["cmdline"])
           if any("ServedLearner" in part for part in p.info["cmdline"] or [])]  # fmt: skip
    return len(rss), sum(rss) / 2**20


def measure(url: str, base: str, models: int, rounds: int) -> dict:
    import tinker
    from tinker import types

    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([(7 * i + k) % 200 + 3 for k in range(32)]),
            loss_fn_inputs={
                "target_tokens": [(7 * i + k + 1) % 200 + 3 for k in range(32)],
                "weights": [1.0] * 32,
            },
        )
        for i in range(8)
    ]
    adam = types.AdamParams(learning_rate=1e-3)
    with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
        creates, clients = [], []
        for _ in range(models):
            start = time.perf_counter()
            clients.append(sc.create_lora_training_client(base_model=base, rank=4, seed=0).result())
            creates.append(time.perf_counter() - start)
        processes, mib = learner_processes()
        times = []
        for _ in range(rounds + 1):  # (the first a warm-up)
            start = time.perf_counter()
            [f.result() for f in [tc.forward_backward(data, "cross_entropy") for tc in clients]]
            [f.result() for f in [tc.optim_step(adam) for tc in clients]]
            times.append(time.perf_counter() - start)
    return {"creates": creates, "processes": processes, "mib": mib, "rounds": times[1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tmp = scratch("bench-tinker-")
    base = model_folder(None, 64, 2)
    rows = []
    for per in (8, 1):
        proc, url = serve_tinker(ROOT, tmp / f"out-{per}", base, f"serve.models_per_learners={per}",
                                 f"serve.max_models={args.models}")  # fmt: skip
        try:
            got = measure(url, base, args.models, args.rounds)
        finally:
            proc.terminate()
            proc.wait(60)
        r = got["rounds"]
        rows.append([f"serve.models_per_learners={per}", f"{got['creates'][0]:.2f}",
                     f"{statistics.median(got['creates'][1:]):.2f}", f"{got['processes']} ({got['mib']:.0f} MiB)",
                     f"{statistics.median(r):.2f} ({min(r):.2f}-{max(r):.2f})"])  # fmt: skip
    print(
        f"{args.models} LoRA models of one base (rank 4), 2 learners a set, ZeRO-2; {args.rounds} rounds; CPU"
    )
    print(table(["learners", "first create_model, s", "later ones, s (median)", "learner processes (RSS)",
                 "a round on every model, s: median (range)"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
