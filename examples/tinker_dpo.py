"""DPO through tinker-cookbook's own trainer (`tinker_cookbook.preference.train_dpo.main`, unmodified)
on a local JSONL of labelled comparisons, against `rltrain serve`:

    python examples/tinker_dpo.py --base-url http://127.0.0.1:8000 --base-model builtin:tiny \\
        --comparisons comparisons.jsonl --log-path runs/tinker_dpo

Each line of the file: ``{"comparison": {"prompt_conversation": [...], "completion_A": [...],
"completion_B": [...]}, "label": "A"}`` (label A, B or Tie; messages as ``{"role", "content"}``).
Without ``--comparisons`` a few made-up ones are written beside the log (the shorter answer wins).
"""

import argparse
import json
from pathlib import Path

QUESTIONS = ["What is 2+2?", "Name a colour.", "Say hello.", "Count to three.", "What is the sky?",
             "Name a fruit.", "What day follows Monday?", "Spell cat."]  # fmt: skip


def made_up(path: Path) -> Path:
    """Comparisons whose label prefers the shorter of two answers to each question."""
    with path.open("w") as f:
        for q in QUESTIONS:
            short, long = (
                [{"role": "assistant", "content": "Yes."}],
                [{"role": "assistant", "content": "Well, " * 8}],
            )
            comparison = {"prompt_conversation": [{"role": "user", "content": q}], "completion_A": long,
                          "completion_B": short}  # fmt: skip
            f.write(json.dumps({"comparison": comparison, "label": "B"}) + "\n")
    return path


def main() -> None:
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--base-model", default="builtin:tiny")
    parser.add_argument("--comparisons", type=Path, help="JSONL of labelled comparisons")
    parser.add_argument("--renderer", default="role_colon")
    parser.add_argument("--log-path", type=Path, default=Path("runs/tinker_dpo"))
    parser.add_argument("--batch-size", type=int, default=4, help="comparisons per step")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    args.log_path.mkdir(parents=True, exist_ok=True)
    comparisons = args.comparisons or made_up(args.log_path / "comparisons.jsonl")
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=args.base_model, renderer_name=args.renderer,
                                            max_length=512, batch_size=args.batch_size)  # fmt: skip
    config = train_dpo.Config(
        log_path=str(args.log_path), model_name=args.base_model, renderer_name=args.renderer, recipe_name="dpo",
        dataset_builder=DPODatasetBuilderFromComparisons(
            common_config=common, comparison_builder=ComparisonBuilderFromJsonl(train_path=str(comparisons))
        ),
        learning_rate=1e-4, lora_rank=4, base_url=args.base_url, max_steps=args.steps,
    )  # fmt: skip
    train_dpo.main(config)


if __name__ == "__main__":
    main()
