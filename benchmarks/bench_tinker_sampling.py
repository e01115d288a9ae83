"""`rltrain serve` sampling many requests at once, through the unmodified Tinker SDK: 16 concurrent
requests of 1 sample against 1 request of 16 samples (the same prompt, tokens and settings), the
same 16 split between two models' sampling clients (merged weights, held one model's at a time,
against adapters side by side), and the step time of the cookbook's `math_rl` recipe
(env=arithmetic) at `groups_per_batch=8 group_size=8`, which sends its groups' requests at once.

    python benchmarks/bench_tinker_sampling.py [--rounds 5] [--max-tokens 32] [--root DIR]

``--root``: the checkout whose `rltrain serve` runs (another worktree: the figures before a change;
the SDK side is the same). The two sampling shapes alternate over the rounds, on one warm server;
each round's ratio is (16 requests of 1) / (1 request of 16) in seconds, the median and range shown.
Needs `tinker` and `tinker-cookbook` (scripts/setup_env.sh installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import model_folder, scratch, serve_tinker, table

ROOT = Path(__file__).resolve().parents[1]
KEY = "tml-bench"


def sampling_rounds(url: str, base: str, rounds: int, max_tokens: int) -> list[tuple[float, float]]:
    """(seconds of 1 request of 16, seconds of 16 concurrent requests of 1) per round."""
    import tinker
    from tinker import types

    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    params = types.SamplingParams(max_tokens=max_tokens, stop=[])  # (every sample runs max_tokens)
    out = []
    with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=4).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        for _ in range(2):  # warm-up: both shapes once
            sampler.sample(prompt, 16, params).result()
            [f.result() for f in [sampler.sample(prompt, 1, params) for _ in range(16)]]
        for i in range(rounds):
            times = {}
            for shape in ("one", "many") if i % 2 == 0 else ("many", "one"):
                start = time.perf_counter()
                if shape == "one":
                    sampler.sample(prompt, 16, params).result()
                else:
                    [f.result() for f in [sampler.sample(prompt, 1, params) for _ in range(16)]]
                times[shape] = time.perf_counter() - start
            out.append((times["one"], times["many"]))
    return out


def two_models_rounds(url: str, base: str, rounds: int, max_tokens: int, train_unembed: bool) -> list[float]:
    """Per round: (16 concurrent requests of 1, 8 on each of two models' sampling clients,
    interleaved) / (1 request of 16 on one of them). With ``train_unembed`` the engines hold merged
    weights, one model's at a time; without it, both models' adapters side by side."""
    import tinker
    from tinker import types

    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    params = types.SamplingParams(max_tokens=max_tokens, stop=[])
    out = []
    with tinker.ServiceClient(base_url=url, api_key=KEY) as sc:
        samplers = [
            sc.create_lora_training_client(base_model=base, rank=4, seed=i, train_unembed=train_unembed)
            .result()
            .save_weights_and_get_sampling_client()
            .result()
            for i in range(2)
        ]
        for i in range(rounds + 1):  # (the first a warm-up)
            start = time.perf_counter()
            samplers[0].sample(prompt, 16, params).result()
            one = time.perf_counter() - start
            start = time.perf_counter()
            [f.result() for f in [samplers[k % 2].sample(prompt, 1, params) for k in range(16)]]
            if i:
                out.append((time.perf_counter() - start) / one)
    return out


def math_rl_step_s(url: str, base: str, log: Path, steps: int) -> float:
    """The median step time of the recipe after its first step (``time/total`` of its metrics)."""
    cmd = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic", f"model_name={base}",
           "renderer_name=role_colon", f"base_url={url}", "loss_fn=importance_sampling", "lora_rank=4",
           "group_size=8", "groups_per_batch=8", "max_tokens=16", f"max_steps={steps}", "eval_every=0",
           "save_every=0", f"log_path={log}", "behavior_if_log_dir_exists=delete"]  # fmt: skip
    env = {**os.environ, "TINKER_API_KEY": KEY, "TINKER_TELEMETRY": "0", "WANDB_MODE": "disabled"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])
    rows = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    totals = [r["time/total"] for r in rows if "time/total" in r]
    return statistics.median(totals[1:] or totals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="math_rl steps (the first left out)")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose server runs")
    args = parser.parse_args()
    tmp = scratch("bench-tinker-")
    base = model_folder(None, 64, 2)
    proc, url = serve_tinker(args.root.resolve(), tmp / "out", base)
    try:
        rounds = sampling_rounds(url, base, args.rounds, args.max_tokens)
        merged = two_models_rounds(url, base, args.rounds, args.max_tokens, train_unembed=True)
        side = two_models_rounds(url, base, args.rounds, args.max_tokens, train_unembed=False)
        step = math_rl_step_s(url, base, tmp / "math_rl", args.steps)
    finally:
        proc.terminate()
        proc.wait(60)
    ratios = [many / one for one, many in rounds]
    print(
        f"server: {args.root.resolve()}; {args.max_tokens} tokens a sample; {args.rounds} alternating rounds; CPU"
    )
    print(table(["16 requests of 1 / 1 request of 16 (median, range)", "1 of 16, s (median)",
                 "16 of 1, s (median)", "math_rl step s (groups_per_batch=8 group_size=8)"],
                [[f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                  f"{statistics.median(r[0] for r in rounds):.2f}", f"{statistics.median(r[1] for r in rounds):.2f}",
                  f"{step:.2f}"]]))  # fmt: skip
    print(
        "16 concurrent requests of 1 on two models' sampling clients (8 each, interleaved) / 1 request of 16:"
    )
    print(table(["engines hold", "median (range)"],
                [[name, f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"]
                 for name, r in (("merged weights, one model's at a time (train_unembed)", merged),
                                 ("both models' adapters side by side", side))]))  # fmt: skip


if __name__ == "__main__":
    main()
