"""Supervised warm start before RL, on the policy learners' own engine path.

:class:`~rltrain.learner.sft.SFTLearner` (a policy learner whose loss is the cross-entropy of the
completion tokens) is trained by :func:`warm_start` for
``sft_warmup.steps`` optimizer steps and writes the model to ``<output_dir>/sft_model/``; a run
that finds it there (resume, restart) starts RL from it without repeating the warm-up.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm

from rltrain.batch import Completion, TrainBatch, collate
from rltrain.config import BUILTIN_TASK, SFT_FROM_ENV, Config
from rltrain.data import (
    LOCAL_FORMATS,
    local_files,
    sft_conversations,
    sft_examples,
    tokenize_completion,
    tokenize_prompts,
)
from rltrain.episodes.chat import Encoded, render_conversations
from rltrain.learner.group import LearnerGroup
from rltrain.learner.sft import SFTLearner
from rltrain.models.images import vision_inputs
from rltrain.run import checkpoint

DONE = "rltrain_sft.json"  # written last into sft_model/: the warm-up finished, with these settings


class BadExamples(ValueError):
    """A warm-up example that cannot be encoded (the run stops with its one line)."""


def warmed(config: Config, model_path: str, out: Path) -> str | None:
    """The folder of a warmed-up model an earlier attempt of this run wrote with these settings."""
    folder = out / "sft_model"
    done = folder / DONE
    if done.exists() and json.loads(done.read_text())["settings"] == _settings(config, model_path):
        return str(folder)
    return None


def warm_start(config: Config, model_path: str, rows: list[dict], tokenizer, out: Path, check=None) -> str:
    """The warmed-up model's folder (trained now, or found from an earlier attempt of this run).
    ``check``: called with the warm start's learners before they train (the engines against them)."""
    sft, folder = config.sft_warmup, out / "sft_model"
    settings = _settings(config, model_path)
    done = folder / DONE
    if (found := warmed(config, model_path, out)) is not None:
        return found
    # a vision-language model's processor renders examples with images (it loads at the first)
    images = vision_inputs(config, model_path)
    if sft.source == SFT_FROM_ENV:
        encoded = demonstrations(config, rows, tokenizer, images)
    elif (written := sft_conversations(sft.source)) is not None:
        try:  # (preflight rendered the first few)
            encoded = render_conversations(
                written, tokenizer, config.env.render, images, config.data.max_image_pixels
            )
        except ValueError as e:
            raise BadExamples(f"sft_warmup.source {sft.source!r}: {e}") from None
    else:
        encoded = encode_examples(sft_examples(sft, rows, config.run.seed), tokenizer, config, images)
    learners = LearnerGroup(config, model_path, sft.steps, SFTLearner)
    rng, losses, start = random.Random(config.run.seed), [], time.perf_counter()
    try:
        if check is not None:
            check(learners=learners)
        # a bar on a terminal; in a log file a line at every fifth of the way
        with tqdm(total=sft.steps, desc="sft warm-up", unit="step", dynamic_ncols=True, leave=False,
                  disable=None) as bar:  # fmt: skip
            for step in range(1, sft.steps + 1):
                chosen = [encoded[rng.randrange(len(encoded))] for _ in range(sft.batch_size)]
                losses.append(learners.train_step(_batch(chosen, tokenizer.pad_token_id))["sft/loss"])
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
                bar.update(1)
                if bar.disable and step % max(1, sft.steps // 5) == 0 and step < sft.steps:
                    tqdm.write(f"sft warm-up: step {step}/{sft.steps}, loss {losses[-1]:.3f}")
        checkpoint.export_hf(learners, folder)
    finally:
        learners.shutdown()
    elapsed = time.perf_counter() - start
    done.write_text(json.dumps({"settings": settings, "loss": losses, "seconds": elapsed}))
    tqdm.write(f"sft warm-up: {sft.steps} steps in {elapsed:.0f}s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return str(folder)


def demonstrations(config: Config, rows: list[dict], tokenizer, images=None) -> list[Encoded]:
    """The environment's ``demonstration(row)`` conversations, rendered as its episodes are
    (``images``: a vision-language model's :class:`~rltrain.models.images.ImageInputs`)."""
    from rltrain.episodes.environments import load_environment, tool_schemas

    env_class, kwargs = load_environment(config.env.name), config.env.kwargs
    schemas = tool_schemas(env_class(**kwargs).tools)
    written = [(env_class(**kwargs).demonstration(row), schemas) for row in rows]
    return render_conversations(written, tokenizer, config.env.render, images, config.data.max_image_pixels)


def encode_examples(examples: list[dict], tokenizer, config: Config, images=None) -> list[Encoded]:
    """``{"prompt", "completion"}`` examples as (prompt ids, completion ids, tool mask): the prompt
    in the chat format (with an example's ``images``, rendered by the model's processor,
    ``images``: its :class:`~rltrain.models.images.ImageInputs`), followed by an example's
    ``given`` start of the assistant turn (untrained, as the prompt is), if it has one."""
    rows = [{"prompt": e["prompt"], "answer": "", "images": e.get("images")} for e in examples]
    prompts = [p.token_ids for p in tokenize_prompts(rows, tokenizer, config.data.model_copy(
        update={"max_prompt_tokens": 10**9}), images)]  # fmt: skip
    return [(prompt + tokenize_completion(e.get("given", ""), tokenizer, eos=False)[0],
             *tokenize_completion(e["completion"], tokenizer)) for prompt, e in zip(prompts, examples)]  # fmt: skip


def _batch(chosen: list[Encoded], pad_id: int) -> TrainBatch:
    prompts = [prompt for prompt, _, _ in chosen]
    completions = [Completion(ids, [0.0] * len(ids), mask) for _, ids, mask in chosen]
    return collate(prompts, completions, torch.zeros(len(chosen)), pad_id)


# what does not change the warmed-up model: where Ray puts the learners, whether they compute a
# shared prompt once (the same outputs, checked; in token mode, where micro-batches' composition,
# which sharing changes, leaves the update as it is), how RL draws its prompts, and the built-in
# task's example mix for a warm start on other examples
NOT_IN_THE_KEY = {
    "learner": {"cpus_per_learner", "gpus_per_learner", "placement", "prefix_sharing"},
    "data": {"difficulty_sampling"},
    "sft_warmup": {"lora", "tool_fraction", "copy_fraction"},
}


def _settings(config: Config, model_path: str) -> str:
    """What the warmed-up model depends on, and nothing else (:data:`NOT_IN_THE_KEY`): the warm-up
    section (and a file's contents), the start model, data, seed, the learners' resolved section
    (optimizer, betas, clipping, precision, layout), how the loss is aggregated and normalized (the
    warm-up's loss follows `loss.aggregation` and `masked_mean_denominator`), whether a vision
    tower trains and, with LoRA, the adapters it trains."""
    loss = config.loss
    norm = config.aggregation_norm if loss.aggregation == "seq-mean-token-sum-norm" else None
    aggregation = [loss.aggregation, norm, loss.masked_mean_denominator]
    # (outside token mode each micro-batch's mean weighs its tokens: which sequences travel together,
    # trees planned whole under sharing, changes the update)
    dropped = NOT_IN_THE_KEY["learner"] - (
        set() if loss.masked_mean_denominator == "token" else {"prefix_sharing"}
    )
    learners = SFTLearner.section(config).model_dump(exclude=dropped)
    sft = config.sft_warmup
    generated = sft.source == BUILTIN_TASK  # tool_fraction and copy_fraction shape its examples alone
    parts = [
        sft.model_dump(exclude={"lora"} if generated else NOT_IN_THE_KEY["sft_warmup"]),
        model_path,
        config.data.model_dump(exclude=NOT_IN_THE_KEY["data"]),
        config.run.seed,
        aggregation,
        learners,
    ]
    if config.sft_warmup.source == SFT_FROM_ENV:
        parts.append(config.env.model_dump())
    elif (path := Path(config.sft_warmup.source).expanduser()).exists():  # a file's contents, not its name
        files = local_files(path, tuple(LOCAL_FORMATS))  # .jsonl among them
        parts.append([hashlib.sha256(f.read_bytes()).hexdigest() for f in files])
    if not config.model.freeze_vision:  # a vision-language model's tower trained too (the default
        parts.append({"freeze_vision": False})  # keeps the key a run of a text model has)
    if config.model.lora.rank and config.sft_warmup.lora:  # a warm start of adapters (one of every
        parts.append(config.model.lora.model_dump())  # weight keeps the key a run without LoRA has)
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
