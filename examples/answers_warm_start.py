"""Warm-start examples for a reasoning-gym task: the first N of a run's training rows with their
bare answers, as a prompt/completion .jsonl for ``sft_warmup.source``. A small model that answers
in sentences ("The answer is 7.") earns a reasoning-gym scorer's partial credit at best; a few
dozen warm-up steps on these teach it the answer format before RL (docs/environments.md).

    python examples/answers_warm_start.py reasoning_gym:chain_sum \\
        '{"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}' 256 warm_start.jsonl

``--size`` and ``--seed`` must be the run's ``data.size`` and ``data.seed`` (2000 and 0 by
default): the examples are then training rows, and no held-out question is among them.
"""

import argparse
import json

from rltrain.tasks import task_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", help="data.source, reasoning_gym:<name>")
    parser.add_argument("task_config", help="data.task_config as JSON")
    parser.add_argument("count", type=int, help="examples to write (the first training rows)")
    parser.add_argument("out", help="the .jsonl to write")
    parser.add_argument("--size", type=int, default=2000, help="data.size")
    parser.add_argument("--seed", type=int, default=0, help="data.seed")
    args = parser.parse_args()
    rows = task_rows(args.source, args.size, args.seed, json.loads(args.task_config), "source")
    with open(args.out, "w") as f:
        for row in rows[: args.count]:
            answer = json.loads(row["answer"])["answer"]  # the row's answer column: the entry as JSON
            f.write(json.dumps({"prompt": row["prompt"], "completion": answer}) + "\n")


if __name__ == "__main__":
    main()
