"""Prompts: loading, chat templating, and a resumable shuffled order (no ray, no deepspeed).

Sources: ``builtin:arithmetic`` (generated, for the CPU demo), a local ``.jsonl``/``.json``/
``.parquet``/``.arrow`` file or folder, or a Hugging Face hub dataset name (loaded with
``datasets``; never used by the tests, which have no network).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from rltrain.config import BUILTIN_TASK, DataConfig

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass
class Prompt:
    index: int  # row in the dataset
    token_ids: list[int]
    answer: str


def arithmetic_rows(n: int = 512, seed: int = 1234) -> list[dict[str, str]]:
    """Small addition/subtraction questions with integer answers."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        op = rng.choice("+-")
        rows.append(
            {
                "prompt": f"What is {a} {op} {b}? Answer with the number.",
                "answer": str(a + b if op == "+" else a - b),
            }
        )
    return rows


def load_rows(config: DataConfig) -> list[dict]:
    if config.source == BUILTIN_TASK:
        return arithmetic_rows()
    import datasets

    path = Path(config.source).expanduser()
    if path.exists():
        files = sorted(p for p in (path.iterdir() if path.is_dir() else [path]) if p.suffix in LOCAL_FORMATS)
        if not files:
            raise ValueError(f"data.source: no {'/'.join(LOCAL_FORMATS)} files in {str(path)!r}")
        builder = LOCAL_FORMATS[files[0].suffix]
        dataset = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    else:
        dataset = datasets.load_dataset(config.source, config.subset, split=config.split)
    missing = {config.prompt_key, config.answer_key} - set(dataset.column_names)
    if missing:
        raise ValueError(
            f"data.source {config.source!r} has no column(s) {sorted(missing)}; it has {dataset.column_names} "
            "(set data.prompt_key / data.answer_key)"
        )
    rows = [{"prompt": r[config.prompt_key], "answer": str(r[config.answer_key])} for r in dataset]
    if config.answer_pattern:
        pattern = re.compile(config.answer_pattern, re.MULTILINE)
        for i, row in enumerate(rows):
            match = pattern.search(row["answer"])
            if match is None:
                raise ValueError(
                    f"data.answer_pattern {config.answer_pattern!r} does not match row {i}'s answer"
                )
            row["answer"] = match.group(1).strip()
    return rows


def tokenize_prompts(rows: list[dict], tokenizer, config: DataConfig) -> list[Prompt]:
    prompts = []
    for i, row in enumerate(rows):
        messages = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
        messages.append({"role": "user", "content": row["prompt"]})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        if len(ids) > config.max_prompt_tokens:
            raise ValueError(
                f"data: prompt {i} has {len(ids)} tokens, over data.max_prompt_tokens={config.max_prompt_tokens}"
            )
        prompts.append(Prompt(i, list(ids), row["answer"]))
    if not prompts:
        raise ValueError(f"data.source {config.source!r} holds no rows")
    return prompts


class PromptSampler:
    """Shuffled passes over the prompts; ``state()``/``load_state()`` make resumption exact."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed = prompts, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Prompt]:
        out = []
        while len(out) < n:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            out.append(self.prompts[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._shuffle(self.epoch)
