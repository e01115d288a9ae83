"""What a demo model does once it calls the calculator: each held-out question answered greedily
with the call forced (decoding starts after ``<tool:calculator>``), the calculator's result put in
as the tool loop puts it, then the model's own answer. Counts the questions whose call copies the
question's numbers right and whose answer copies the result right, for each saved model given.

    python benchmarks/demo_copying.py runs/cpu_demo/sft_model runs/cpu_demo/final_model [--config configs/cpu_demo.yaml]

A warm start that copies on most questions leads to a run that ends near 100% held-out; one that
does not leads to a plateau RL barely lifts (docs/demo.md). Needs only transformers, no Ray.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rltrain.config import load_config
from rltrain.data import ARITHMETIC, CALL_TAG, arithmetic_rows, chat_prompts, split_held_out
from rltrain.episodes.tools import ToolRunner

CALLED = re.compile(r"(.*?)</tool>", re.DOTALL)
BOTH = ("call right", "answer copied")


def greedy(model, tokenizer, ids: list[int], stop: str, limit: int) -> tuple[list[int], str]:
    """Greedy continuation of ``ids`` until ``stop`` or the end token: (all ids, the new text)."""
    ids, new = list(ids), []
    with torch.no_grad():
        for _ in range(limit):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            new.append(token)
            if token == tokenizer.eos_token_id or tokenizer.decode(new).endswith(stop):
                break
    return ids, tokenizer.decode(new, skip_special_tokens=True)


def copying(folder: str, config_path: str) -> Counter:
    config = load_config(config_path, [])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    _, held = split_held_out(arithmetic_rows(), config.data, config.eval)
    tools = ToolRunner.from_config(config.rollout.tools)  # the run's calculator, wrapped as the loop does
    forced = tokenizer(CALL_TAG, add_special_tokens=False)["input_ids"]
    counts = Counter()
    for row, prompt in zip(held, chat_prompts([r["prompt"] for r in held], tokenizer, config.data)):
        ids, text = greedy(model, tokenizer, [*prompt, *forced], "</tool>", 40)
        called = CALLED.match(text)
        expression = called.group(1) if called else text
        observation, _ = tools("calculator", expression)
        ids += tokenizer(observation, add_special_tokens=False)["input_ids"]
        _, answer = greedy(model, tokenizer, ids, tokenizer.eos_token, 12)
        call_right = expression == " ".join(ARITHMETIC.match(row["prompt"]).groups())
        answer_right = answer.strip() == observation.removeprefix("<result>").removesuffix("</result>")
        call = "call right" if call_right else "call wrong"
        counts[call, "answer copied" if answer_right else "answer miscopied"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="saved model folders (sft_model/, final_model/)")
    parser.add_argument("--config", default="configs/cpu_demo.yaml")
    args = parser.parse_args()
    for folder in args.models:
        counts = copying(folder, args.config)
        n = sum(counts.values())
        rest = ", ".join(f"{c} / {a}: {k}" for (c, a), k in sorted(counts.items()) if (c, a) != BOTH)
        print(f"{folder}: both copies right on {counts[BOTH] / n:.1%} of {n} ({rest})")


if __name__ == "__main__":
    main()
