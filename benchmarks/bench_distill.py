"""On-policy distillation against GRPO from the same start, and a learned reward model as the only
reward, on the CPU demo's task.

    python benchmarks/bench_distill.py [--seeds 0 1] [--teacher-seed 0] [--steps 40] [--eval-every 2]
                                       [--rm-kl-beta 0.1]

Per seed:

1. **The demo** (`configs/cpu_demo.yaml`): its warm start is the *student*, its 40 GRPO steps
   (correctness reward) are the GRPO curve; the final model of ``--teacher-seed``'s demo is the
   *teacher* of every seed.
2. **Distillation** from the same warm start, the same batch (8 prompts x 8 completions) and the
   same data order: `algorithm.advantage=distill algorithm.teacher=<the demo's final model>`.
3. **A reward model** trained here: the warm-started model with a one-label head, trained on
   labelled right and wrong answers of the built-in task's training questions (answered directly
   or through the calculator, right or with a wrong number), then GRPO from the warm start with
   `reward.functions={model: 1.0}`: the reward model's score is the only reward; once as it is
   and once with a KL penalty to the warm start (``--rm-kl-beta``), the usual guard against
   over-optimizing a learned reward.

Prints held-out accuracy (200 questions never trained on, greedy) every ``--eval-every`` steps for
each, the steps each needs to come within 5 points of the teacher, and the seconds per step.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import scratch, table

REPO = Path(__file__).resolve().parents[1]


def train(out: Path, seed: int, overrides: list[str]) -> tuple[list[dict], float]:
    """A ``configs/cpu_demo.yaml`` run; its evaluation rows and seconds per training step."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", f"run.seed={seed}",
         f"run.output_dir={out}", "run.checkpoint_every=0", *overrides],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    print(f"done: {out.name} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["time/step_s"] for r in rows if "time/step_s" in r]
    return [r for r in rows if "eval/accuracy" in r], sum(steps) / len(steps)


def labelled_answers(n: int, seed: int) -> list[tuple[str, str, float]]:
    """``(question, completion, label)`` in the demo's completion format, as a verifier would label
    the warm-started policy's own answers: half answered from memory (right 40% of the time, else
    off by 1 to 10), half through the calculator (the call copies both numbers right 80% of the
    time; otherwise one is copied wrong, and the call's result answers a question not asked)."""
    from rltrain.data import ARITHMETIC, arithmetic_rows

    rng, examples = random.Random(seed), []
    for row in arithmetic_rows(n, seed=seed + 99):  # questions of the task's kind, drawn afresh
        a, op, b = ARITHMETIC.match(row["prompt"]).groups()
        answer = int(row["answer"])
        if rng.random() < 0.5:
            value = answer if rng.random() < 0.4 else answer + rng.choice([-1, 1]) * rng.randint(1, 10)
            examples.append((row["prompt"], str(value), float(value == answer)))
            continue
        if rng.random() >= 0.8:  # one operand copied wrong
            b = str(int(b) + rng.choice([-1, 1]) * rng.randint(1, 10))
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        completion = f"<tool:calculator>{a} {op} {b}</tool><result>{value}</result> {value}"
        examples.append((row["prompt"], completion, float(value == answer)))
    return examples


def train_reward_model(start: Path, out: Path, seed: int, steps: int = 400) -> float:
    """A one-label classifier from ``start`` (the warm-started policy) trained with binary
    cross-entropy on :func:`labelled_answers`; saved to ``out``; its accuracy on held-back examples."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rltrain.config import DataConfig
    from rltrain.data import chat_prompt, tokenize_completion

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(start)
    model = AutoModelForSequenceClassification.from_pretrained(start, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id

    def encode(question: str, completion: str) -> list[int]:  # as the run's sequences: prompt + completion
        return chat_prompt(question, tokenizer, DataConfig()) + tokenize_completion(completion, tokenizer)[0]

    examples = [(encode(q, c), y) for q, c, y in labelled_answers(2048, seed)]
    train_set, test_set = examples[:1792], examples[1792:]

    def scores(batch):
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tokenizer.pad_token_id] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        return model(input_ids=ids, attention_mask=mask).logits[:, 0]

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    rng = random.Random(seed)
    for _ in range(steps):
        batch = rng.sample(train_set, 64)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            scores(batch), torch.tensor([y for _, y in batch])
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        accuracy = ((scores(test_set) > 0).float() == torch.tensor([y for _, y in test_set])).float().mean()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return float(accuracy)


def within(curve: list[dict], target: float) -> str:
    """The first evaluated step at or above ``target``, or '-'."""
    return next((str(r["step"]) for r in curve if r["eval/accuracy"] >= target), "-")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument(
        "--teacher-seed", type=int, default=0, help="whose demo's final model teaches every seed"
    )
    parser.add_argument(
        "--rm-kl-beta", type=float, default=0.1, help="loss.kl_beta of the second reward-model run"
    )
    args = parser.parse_args()
    tmp = scratch("bench-distill-")
    common = [f"run.steps={args.steps}", f"run.eval_every={args.eval_every}"]
    demos = {}
    for seed in dict.fromkeys([args.teacher_seed, *args.seeds]):  # the teacher's demo first
        demos[seed] = train(tmp / f"demo-seed{seed}", seed, common)
    teacher = tmp / f"demo-seed{args.teacher_seed}" / "final_model"
    teacher_accuracy = demos[args.teacher_seed][0][-1]["eval/accuracy"]
    for seed in args.seeds:
        grpo, grpo_s = demos[seed]
        start = tmp / f"demo-seed{seed}" / "sft_model"
        from_start = [*common, f"model.name_or_path={start}", "sft_warmup.steps=0"]
        distill, distill_s = train(tmp / f"distill-seed{seed}", seed, [
            *from_start, "algorithm.advantage=distill", f"algorithm.teacher={teacher}"])  # fmt: skip
        rm_accuracy = train_reward_model(start, tmp / f"rm-seed{seed}", seed)
        print(f"reward model: {rm_accuracy:.1%} right on held-back labelled answers", file=sys.stderr)
        with_rm = [*from_start, f"reward.model={tmp / f'rm-seed{seed}'}", "reward.functions={model: 1.0}"]
        rm, rm_s = train(tmp / f"rm-run-seed{seed}", seed, with_rm)
        rm_kl, rm_kl_s = train(
            tmp / f"rm-kl-run-seed{seed}", seed, [*with_rm, f"loss.kl_beta={args.rm_kl_beta}"]
        )
        target = teacher_accuracy - 0.05  # within 5 points of the teacher
        runs = {"GRPO (correctness)": (grpo, grpo_s), "distillation": (distill, distill_s),
                "GRPO (reward model only)": (rm, rm_s),
                f"GRPO (reward model only, kl_beta {args.rm_kl_beta:g})": (rm_kl, rm_kl_s)}  # fmt: skip
        header = ["run", *(f"step {r['step']}" for r in grpo), "steps to teacher - 5 pts", "s/step"]
        rows = [[name, *(f"{r['eval/accuracy']:.1%}" for r in curve), within(curve, target), f"{s:.2f}"]
                for name, (curve, s) in runs.items()]  # fmt: skip
        print(f"seed {seed}: held-out accuracy (greedy, 200 questions); the teacher is seed {args.teacher_seed}'s "
              f"demo's final model ({teacher_accuracy:.1%}); reward model {rm_accuracy:.1%} right on held-back labels")  # fmt: skip
        print(table(header, rows))


if __name__ == "__main__":
    main()
