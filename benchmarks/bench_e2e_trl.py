"""A GRPO training step end to end (generate + score + train + sync) of rltrain against TRL's
GRPOTrainer: same tiny model, prompts, group size, completion length, reward, one optimizer step
per training step. Generated tokens per second for both, and the ratio, measured in one run.

    python benchmarks/bench_e2e_trl.py [--prompts 8] [--group 8] [--length 32] [--steps 6] [--hidden 64 --layers 2]

rltrain runs its CPU layout (2 DeepSpeed learners + 1 vLLM engine on Ray); TRL runs its single
process trainer with transformers `generate` (its vLLM colocate mode does not sync weights on CPU).
The first step of each (warm-up) is left out. Needs `trl` (`make bench` installs it).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import model_folder, table

from rltrain.data import arithmetic_rows
from rltrain.rewards import digits_reward

REPO = Path(__file__).resolve().parents[1]


def run_rltrain(model: str, args, out: Path) -> tuple[float, float]:
    overrides = [
        f"model.name_or_path={model}",
        f"algorithm.prompts_per_step={args.prompts}",
        f"algorithm.group_size={args.group}",
        f"rollout.max_new_tokens={args.length}",
        "algorithm.overlong=none",
        "rollout.tools.enabled=[]",
        "reward.functions={digits: 1.0}",
        f"run.steps={args.steps}",
        "run.checkpoint_every=0",
        f"run.output_dir={out}",
        "learner.num_mini_batches=1",
        f"learner.lr={args.lr}",
    ]
    subprocess.run(
        [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", *overrides],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    tokens = sum(r["rollout/length_mean"] * r["train/sequences"] for r in rows)
    seconds = sum(r["time/step_s"] for r in rows)
    return tokens, seconds


def run_trl(model: str, args, out: Path) -> tuple[float, float]:
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
        max_completion_length=args.length,
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
    return float(sum(tokens_per_step[1:])), sum(step_seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=64, help="size of the built-in model")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--model", default=None, help="a model folder instead of the built-in one")
    args = parser.parse_args()
    model = model_folder(args.model, args.hidden, args.layers)
    tmp = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    results = {
        "rltrain": run_rltrain(model, args, tmp / "rltrain"),
        "TRL GRPOTrainer": run_trl(model, args, tmp / "trl"),
    }
    rows = [
        [name, f"{tokens:.0f}", f"{seconds:.1f}", f"{tokens / seconds:.0f}"]
        for name, (tokens, seconds) in results.items()
    ]
    speed = {name: tokens / seconds for name, (tokens, seconds) in results.items()}
    size = args.model or f"built-in model (hidden {args.hidden}, {args.layers} layers)"
    print(f"{size}; {args.prompts} prompts x {args.group} completions, up to {args.length} tokens; "
          f"steps 2-{args.steps}; CPU")  # fmt: skip
    print(table(["trainer", "generated tokens", "seconds", "tokens/s"], rows))
    print(f"rltrain / TRL tokens per second: {speed['rltrain'] / speed['TRL GRPOTrainer']:.2f}")


if __name__ == "__main__":
    main()
