"""Prompts: loading and chat templating (no ray, no deepspeed); which ones each step draws is
:mod:`rltrain.prompt_sampler`.

Sources: ``builtin:arithmetic`` (generated, for the CPU demo), ``builtin:guess`` (episodes of the
guessing game), a local ``.jsonl``/``.json``/
``.parquet``/``.arrow`` file or folder, or a Hugging Face hub dataset name (loaded with
``datasets``; never used by the tests, which have no network).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rltrain import tasks
from rltrain.config import BUILTIN_TASK, DataConfig, EvalConfig, SFTWarmupConfig, first_line
from rltrain.media import images_of

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


@dataclass
class Prompt:
    index: int  # row in the dataset
    token_ids: list[int]  # empty with an environment: each episode renders its own opening
    answer: str
    row: dict | None = None  # the data row (an environment's reset takes it)


def arithmetic_rows(n: int = 2048, seed: int = 1234, digits: Sequence[int] = ()) -> list[dict[str, str]]:
    """Small addition/subtraction questions with integer answers: operands 0-50, or, with
    ``digits``, two operands of one of these many digits, drawn per question (1: 0-9; 3: 100-999),
    so questions of visibly different difficulty mix."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        if digits:
            d = rng.choice(digits)
            low, high = (0 if d == 1 else 10 ** (d - 1)), 10**d - 1
        else:
            low, high = 0, 50
        a, b = rng.randint(low, high), rng.randint(low, high)
        op = rng.choice("+-")
        rows.append(
            {
                "prompt": f"What is {a} {op} {b}? Answer with the number.",
                "answer": str(a + b if op == "+" else a - b),
            }
        )
    return rows


def episode_rows(n: int = 2048, seed: int = 1234) -> list[dict[str, str]]:
    """Episodes of ``builtin:guess`` and ``builtin:chain``: each row's answer seeds its episode (the
    secret of rltrain.envs.GuessEnv, the numbers of rltrain.envs.ChainEnv)."""
    rng = random.Random(seed)
    return [{"prompt": "guess", "answer": str(rng.randrange(10**6))} for _ in range(n)]


SHAPE_COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 220)}
SHAPES_QUESTION = "What colour is the square? Answer red, green or blue."


def shapes_rows(n: int = 2048, seed: int = 1234, size: int = 56) -> list[dict]:
    """``builtin:shapes``: a picture of one square on white (``size`` pixels a side: 2 x 2 merged
    patches of a Qwen2-VL-style processor at 56), drawn on the spot, and the question of its colour:
    the text is the same in every row, so only the image answers it."""
    import io

    from PIL import Image, ImageDraw

    rng, rows = random.Random(seed), []
    for _ in range(n):
        name = rng.choice(list(SHAPE_COLOURS))
        image = Image.new("RGB", (size, size), (255, 255, 255))
        side = rng.randint(size // 4, size // 2)
        x, y = rng.randint(0, size - side), rng.randint(0, size - side)
        ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=SHAPE_COLOURS[name])
        encoded = io.BytesIO()
        image.save(encoded, format="PNG")
        rows.append({"prompt": SHAPES_QUESTION, "answer": name, "images": [encoded.getvalue()]})
    return rows


BUILTIN_SOURCES = {
    BUILTIN_TASK: arithmetic_rows,
    "builtin:guess": episode_rows,
    "builtin:chain": episode_rows,
    "builtin:shapes": shapes_rows,
}
IMAGE_SOURCES = {"builtin:shapes"}  # built-in sources whose rows hold images


def holds_images(config: DataConfig) -> bool:
    """Whether the data's rows hold images (``data.image_column``, or a built-in source of them)."""
    return bool(config.image_column) or config.source in IMAGE_SOURCES


def arithmetic_settings(config: DataConfig, key: str) -> dict:
    """``builtin:arithmetic``'s one setting, ``task_config: {digits: [1, 3]}``, checked."""
    settings = dict(config.task_config)
    unknown = set(settings) - {"digits"}
    digits = settings.get("digits", [])
    if unknown or not all(isinstance(d, int) and 1 <= d <= 6 for d in digits):
        raise ValueError(
            f"{key}: builtin:arithmetic takes one setting, digits (a list of operand lengths, 1-6), "
            f"got {settings}"
        )
    return {"digits": tuple(digits)} if digits else {}


HELD_OUT_SEED = 1_000_003  # a generated task's held-out questions: its seed plus this
ARITHMETIC = re.compile(r"What is (\d+) ([+-]) (\d+)\?")
RESULT = re.compile(r"(<result>.*?</result>)", re.DOTALL)


def split_held_out(rows: list[dict], data: DataConfig, ev: EvalConfig) -> tuple[list[dict], list[dict]]:
    """``(training rows, held-out rows)``: no held-out question is ever a training question."""
    n = ev.num_prompts
    generated = data.source == BUILTIN_TASK or tasks.is_task(data.source)
    if ev.source is None and not generated:
        if len(rows) <= n:
            raise ValueError(
                f"eval.num_prompts={n} would leave none of the {len(rows)} rows of {data.source} to train on"
            )
        return rows[:-n], rows[-n:]
    if ev.source is not None:
        candidates = load_rows(data.model_copy(update={"source": ev.source}), "eval.source")
    elif tasks.is_task(data.source):  # more questions from another seed, drawn apart from the training ones
        candidates = tasks.task_rows(
            data.source, 8 * n, data.seed + HELD_OUT_SEED, data.task_config, "data.source"
        )
    else:  # the built-in task: more questions, drawn apart from the training ones
        candidates = arithmetic_rows(n=8 * n, seed=4321, **arithmetic_settings(data, "data.task_config"))
    seen, held = {r["prompt"] for r in rows}, []
    for row in candidates:
        if row["prompt"] not in seen and len(held) < n:
            held.append(row)
            seen.add(row["prompt"])
    if not held:
        raise ValueError(f"eval.source {ev.source!r}: every question is also a training question")
    return rows, held


CALL_TAG = "<tool:calculator>"


def sft_examples(sft: SFTWarmupConfig, rows: list[dict], seed: int) -> list[dict[str, str]]:
    """Warm-up examples ``{"prompt", "completion"}``: from a .jsonl file, or, for the built-in task,
    its training questions answered directly or (``tool_fraction`` of them) through the calculator;
    ``copy_fraction`` of them instead are given the call's opening tag (``given``: the assistant
    turn's untrained start) and train the rest of the call and the answer copied from its result."""
    if sft.source in IMAGE_SOURCES:  # the task's own rows, answered (images and all)
        return [{"prompt": r["prompt"], "completion": r["answer"], "images": r["images"]} for r in rows]
    if sft.source != BUILTIN_TASK:
        examples = load_rows(
            DataConfig(
                source=sft.source, prompt_key="prompt", answer_key="completion", max_prompt_tokens=10**9
            ),
            "sft_warmup.source",
        )
        return [{"prompt": e["prompt"], "completion": e["answer"]} for e in examples]
    rng, examples = random.Random(seed), []
    for row in rows:
        match = ARITHMETIC.match(row["prompt"])
        if match is None:
            raise ValueError(
                "sft_warmup.source: builtin:arithmetic needs the built-in task's prompts (data.source)"
            )
        expression, answer = " ".join(match.groups()), row["answer"]
        call = f"{expression}</tool><result>{answer}</result> {answer}"
        if sft.copy_fraction and rng.random() < sft.copy_fraction:  # the first token's choice untrained
            examples.append({"prompt": row["prompt"], "given": CALL_TAG, "completion": call})
        elif rng.random() < sft.tool_fraction:
            examples.append({"prompt": row["prompt"], "completion": CALL_TAG + call})
        else:  # the answer as a calculator round trip ends: one first token for "answer now"
            examples.append({"prompt": row["prompt"], "completion": f" {answer}"})
    return examples


ROLES = ("system", "user", "assistant", "tool")
Conversation = tuple[list[dict], list[dict] | None]  # (messages, the tools' JSON schemas or None)


def sft_conversations(source: str) -> list[Conversation] | None:
    """Warm-up conversations in OpenAI's chat fine-tuning format: a local .jsonl whose rows hold
    ``messages`` (system, user, assistant and tool messages; tool calls with their arguments as a
    JSON string or an object) and, optionally, ``tools`` (the JSON schemas the conversation had);
    None when the source's rows are ``prompt``/``completion`` examples (or it is a built-in).
    The loss is on the assistant turns only."""
    path = Path(source).expanduser()
    if source.startswith("builtin:") or not path.exists():
        return None
    files = local_files(path, (".jsonl",))
    records = _read_local(files, "sft_warmup.source") if files else []
    if not records or "messages" not in records[0][1]:
        return None
    return [_conversation(where, record) for where, record in records]


def _conversation(where: str, record: dict) -> Conversation:
    def bad(problem: str) -> ValueError:
        return ValueError(f"sft_warmup.source: {where}: {problem}")

    messages, tools = record.get("messages"), record.get("tools")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise bad("`messages` must be a list of message objects")
    for i, message in enumerate(messages):
        if message.get("role") not in ROLES:
            raise bad(f"message {i} has role {message.get('role')!r}, expected one of {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise bad("no assistant message (the warm start learns the assistant turns)")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise bad("`tools` must be a list of JSON schemas (OpenAI's tools format)")
    return messages, tools or None


def tokenize_completion(text: str, tokenizer, eos: bool = True) -> tuple[list[int], list[int]]:
    """Token ids of a written completion (EOS appended unless ``eos`` is false) and its tool mask: 0
    on ``<result>...</result>`` spans (tool output, encoded apart as the rollout loop does), 1 elsewhere."""
    ids, mask = [], []
    for piece in RESULT.split(text):
        if piece:
            piece_ids = tokenizer.encode(piece, add_special_tokens=False)
            ids += piece_ids
            mask += [0 if RESULT.fullmatch(piece) else 1] * len(piece_ids)
    return (ids + [tokenizer.eos_token_id], mask + [1]) if eos else (ids, mask)


def load_rows(config: DataConfig, key: str = "data.source") -> list[dict]:
    """Every row as ``{"prompt", "answer"}``, validated: a problem raises ValueError naming the
    config ``key`` the source came from, the row (line, for JSON Lines) and the column."""
    if tasks.is_task(config.source):
        return tasks.task_rows(config.source, config.size, config.seed, config.task_config, key)
    if config.source.startswith("builtin:"):
        if config.source not in BUILTIN_SOURCES:
            raise ValueError(
                f"{key}: unknown built-in {config.source!r} (built-ins: {', '.join(BUILTIN_SOURCES)})"
            )
        if config.source == BUILTIN_TASK:
            return arithmetic_rows(**arithmetic_settings(config, "data.task_config"))
        return BUILTIN_SOURCES[config.source]()
    path = Path(config.source).expanduser()
    if path.exists():
        files = local_files(path, tuple(LOCAL_FORMATS))
        if not files:
            raise ValueError(f"{key}: no {'/'.join(LOCAL_FORMATS)} files in {str(path)!r}")
        records = _read_local(files, key)
    else:
        records = _read_hub(config, key)
    base = (path if path.is_dir() else path.parent) if path.exists() else None  # relative image paths' folder
    rows = [_row(where, record, config, key, base) for where, record in records]
    if not rows:
        raise ValueError(f"{key} {config.source!r} holds no rows")
    return rows


def local_files(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """A local source's files: the file itself, or a folder's files, with one of ``suffixes``."""
    return sorted(p for p in (path.iterdir() if path.is_dir() else [path]) if p.suffix in suffixes)


def _read_local(files: list[Path], key: str) -> list[tuple[str, dict]]:
    if all(f.suffix == ".jsonl" for f in files):  # read here, so a bad line can be named
        records = []
        for f in files:
            for n, line in enumerate(f.read_text().splitlines(), start=1):
                if not line.strip():
                    continue
                where = f"{f.name} line {n}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{key}: {where} is not valid JSON ({e.msg})") from None
                if not isinstance(record, dict):
                    raise ValueError(f"{key}: {where} holds a {type(record).__name__}, expected an object")
                records.append((where, record))
        return records
    import datasets

    try:
        dataset = datasets.load_dataset(
            LOCAL_FORMATS[files[0].suffix], data_files=[str(f) for f in files], split="train"
        )
    except Exception as e:
        raise ValueError(f"{key}: cannot read {str(files[0].parent)!r}: {first_line(e)}") from None
    return [(f"row {i}", record) for i, record in enumerate(dataset)]


def _read_hub(config: DataConfig, key: str) -> list[tuple[str, dict]]:
    import datasets

    try:
        dataset = datasets.load_dataset(config.source, config.subset, split=config.split)
    except Exception as e:
        raise ValueError(
            f"{key}: {config.source!r} is no local file and cannot be loaded from the hub: {first_line(e)}"
        ) from None
    return [(f"row {i}", record) for i, record in enumerate(dataset)]


def _row(where: str, record: dict, config: DataConfig, key: str, base: Path | None = None) -> dict:
    """The row's ``prompt`` and ``answer`` (and ``images``, each one's encoded bytes, checked, where
    ``data.image_column`` names a column)."""
    columns = [(config.prompt_key, "prompt_key"), (config.answer_key, "answer_key")]
    for column, name in [*columns, *([(config.image_column, "image_column")] if config.image_column else [])]:
        if column not in record:
            setting = f" (data.{name})" if key == "data.source" else ""
            raise ValueError(
                f"{key} {config.source!r}: {where} has no column {column!r}{setting}; it has {sorted(record)}"
            )
    prompt, answer = record[config.prompt_key], record[config.answer_key]
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(
            f"{key} {config.source!r}: {where}, column {config.prompt_key!r}: expected a non-empty "
            f"string, got {prompt!r}"
        )
    if answer is None or isinstance(answer, dict | list):
        raise ValueError(
            f"{key} {config.source!r}: {where}, column {config.answer_key!r}: expected a string or "
            f"number, got {answer!r}"
        )
    answer = str(answer)
    if config.answer_pattern:
        match = re.search(config.answer_pattern, answer, re.MULTILINE)
        if match is None:
            raise ValueError(
                f"data.answer_pattern {config.answer_pattern!r} does not match the answer of {where} "
                f"in {config.source!r}"
            )
        answer = match.group(1).strip()
    if not config.image_column:
        return {"prompt": prompt, "answer": answer}
    at = f"{key} {config.source!r}: {where}, column {config.image_column!r} (data.image_column)"
    return {"prompt": prompt, "answer": answer,
            "images": images_of(record[config.image_column], at, config.max_image_pixels, base)}  # fmt: skip


def chat_prompt(text: str, tokenizer, config: DataConfig) -> list[int]:
    """A question as the model sees it: the chat template with the generation prompt."""
    return chat_prompts([text], tokenizer, config)[0]


def chat_prompts(texts: list[str], tokenizer, config: DataConfig) -> list[list[int]]:
    """:func:`chat_prompt` of each question, rendered one by one and encoded in one batch (as the
    template's own tokenization does: its text already holds the special tokens)."""
    system = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
    rendered = [
        tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in texts
    ]
    return tokenizer(rendered, add_special_tokens=False)["input_ids"] if rendered else []


def chat_ids(messages: list[dict], tokenizer) -> list[int]:
    """The chat template's token ids of ``messages`` with the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def tokenize_prompts(rows: list[dict], tokenizer, config: DataConfig, images=None) -> list[Prompt]:
    """Each row's prompt as the model sees it (:func:`chat_prompts`); a row with images (a
    vision-language model's, ``images``: its :class:`~rltrain.models.images.ImageInputs`) as an
    :class:`~rltrain.batch.ImagePrompt`, its images first in the user turn, their placeholders
    expanded by the model's processor."""
    text_only = [i for i, r in enumerate(rows) if not r.get("images")]
    rendered: list = [None] * len(rows)
    for i, ids in zip(text_only, chat_prompts([rows[i]["prompt"] for i in text_only], tokenizer, config)):
        rendered[i] = ids
    system = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
    for i, row in enumerate(rows):
        if row.get("images"):
            parts = [{"type": "image"} for _ in row["images"]] + [{"type": "text", "text": row["prompt"]}]
            rendered[i] = images.render([*system, {"role": "user", "content": parts}], row["images"])
    prompts = []
    for i, (row, ids) in enumerate(zip(rows, rendered)):
        if len(ids) > config.max_prompt_tokens:
            raise ValueError(
                f"data: prompt {i} has {len(ids)} tokens, over data.max_prompt_tokens={config.max_prompt_tokens}"
            )
        prompts.append(Prompt(i, ids if hasattr(ids, "images") else list(ids), row["answer"], row))
    if not prompts:
        raise ValueError(f"data.source {config.source!r} holds no rows")
    return prompts


def episode_prompts(rows: list[dict], config: DataConfig) -> list[Prompt]:
    """Prompts of an environment: the rows, rendered by each episode from its opening messages."""
    if not rows:
        raise ValueError(f"data.source {config.source!r} holds no rows")
    return [Prompt(i, [], row["answer"], row) for i, row in enumerate(rows)]
