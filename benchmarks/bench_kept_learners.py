"""A learner group started in new processes against one restarted where a released group stands
(:class:`rltrain.learner.group.KeptLearners`: what the Tinker server does for a model made after
another's session ended, ``serve.kept_learners``, and what the tests' layout checks do between
tests). Each start is timed until the group answers its first call (a training step), the two
ways alternating (new, kept, new, ...) so the machine's load falls on both alike.

    python benchmarks/bench_kept_learners.py [--model <folder>] [--learners 2] [--repeats 5]

Printed: the median seconds of each way and their ratio, and the CPU-seconds every process of the
machine spent meanwhile (on 2 cores, the suite's currency: a group's start is mostly its
processes' imports).
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import model_folder, start_ray, table


def machine_cpu_s() -> float:
    """CPU-seconds all processes have spent since boot (user, nice, system, irq, softirq)."""
    fields = open("/proc/stat").readline().split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / 100


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--learners", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from rltrain.diagnostics import layout_config, synthetic_rollouts
    from rltrain.learner.group import KeptLearners, LearnerGroup

    start_ray()
    path, batch = model_folder(args.model), synthetic_rollouts()
    config = layout_config(args.learners, 2, 2)
    kept = KeptLearners()
    kept.give(LearnerGroup(config, path, 1))  # the group a first user released
    times: dict[str, list[tuple[float, float]]] = {"new processes": [], "kept, restarted": []}
    for _ in range(args.repeats):
        for way in times:
            wall, cpu = time.perf_counter(), machine_cpu_s()
            if way == "new processes":
                group = LearnerGroup(config, path, 1)
            else:
                group = kept.take(config, path, 1)
            group.train_step(batch)
            times[way].append((time.perf_counter() - wall, machine_cpu_s() - cpu))
            if way == "new processes":
                group.shutdown()
            else:
                kept.give(group)
    kept.close()
    medians = {way: [statistics.median(x[i] for x in runs) for i in (0, 1)] for way, runs in times.items()}
    new, reused = medians["new processes"], medians["kept, restarted"]
    print(f"{args.learners} learners, a group's start and first step (median of {args.repeats}):")
    print(
        table(
            ["start", "wall s", "CPU s (machine)"],
            [[w, f"{m[0]:.2f}", f"{m[1]:.1f}"] for w, m in medians.items()],
        )
    )
    print(f"kept/new: wall {reused[0] / new[0]:.2f}x, CPU {reused[1] / new[1]:.2f}x")


if __name__ == "__main__":
    main()
