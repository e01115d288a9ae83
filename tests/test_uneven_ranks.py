"""Ranks that hold different work run the same collectives: real learners (Ray actors, DeepSpeed
engines, gloo) under ``run.check_collectives``, which compares every collective's op and shapes
across the ranks before it runs (torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL``), so a per-rank branch
around a collective fails at once, naming each rank's op, instead of hanging until
``run.actor_timeout_s``. Symmetric batches cannot show such a branch: here one rank's micro-batch
shares a prompt and the other's does not, one rank holds a blank micro-batch, and one rank's
sequences have images while the other's have none. Each layout's update is one learner's."""

from __future__ import annotations

import pytest
import torch

from rltrain.batch import Completion, TrainBatch, collate
from rltrain.config import Config
from rltrain.diagnostics import layout_config, relative_difference, updates_after_one_step

pytestmark = pytest.mark.slow


def config(learners: int, micro_batch_size: int, stage: int, model=None, data=None, **learner) -> Config:
    """:func:`layout_config` for these tests' sequences (prompts of up to 9 tokens, completions
    of up to 12; ``model`` and ``data`` keys); with several learners, every collective checked across ranks."""
    raw = layout_config(learners, micro_batch_size, stage, **learner).model_dump()
    raw["data"]["max_prompt_tokens"], raw["rollout"]["max_new_tokens"] = 9, 12
    if learners > 1:
        raw["run"] |= {"check_collectives": True, "actor_timeout_s": 120}
    raw["model"] |= model or {}
    raw["data"] |= data or {}
    return Config.model_validate(raw)


def batch_of(prompts: list[list[int]], lengths: list[int], seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    completions = [torch.randint(3, 200, (n,), generator=g).tolist() for n in lengths]
    batch = collate(prompts, [Completion(c, [0.0] * len(c), [1] * len(c)) for c in completions],
                    torch.randn(len(prompts), generator=g), pad_id=0)  # fmt: skip
    return batch.replace(generator_logprobs=None)


def test_autos_check_and_blank_micro_batches_under_zero3_run_alike_on_every_rank(
    ray_local, kept_learners, tiny_model_path
):
    # rank 0's micro-batch is a group of 3 sharing a 9-token prompt (auto's check runs its forwards
    # on it, shared and padded), rank 1's holds 3 prompts of their own (nothing to check): before,
    # rank 0 gathered ZeRO-3 weights for the check while rank 1 waited in the check's all-reduce,
    # and both hung. Padded in micro-batches of 3 and packed in 30 tokens the plan is the same:
    # sequences 0-2 on rank 0 (one tree), 3-5 on rank 1 (one packed row). A batch of one sequence
    # leaves rank 1 a blank micro-batch in every forward, the check's too
    shared = list(range(10, 19))
    grouped = batch_of([shared] * 3 + [[30 + i, 40 + i, 50 + i] for i in range(3)], [9, 5, 7, 12, 6, 3])
    single = batch_of([shared], [9], seed=1)
    auto3 = {"prefix_sharing": "auto"}
    configs = [
        config(1, 6, 0, prefix_sharing=False),
        config(2, 3, 3, **auto3),  # padded micro-batches of 3: one each
        config(2, 3, 3, max_tokens_per_micro_batch=30, **auto3),  # packed, a tree on rank 0
        config(1, 1, 0, prefix_sharing=False),
        config(2, 1, 3, max_tokens_per_micro_batch=30, **auto3),  # rank 1: a blank micro-batch
    ]
    batches = [grouped, grouped, grouped, single, single]
    reference, padded, packed, one, blank = updates_after_one_step(configs, tiny_model_path, batches)
    assert relative_difference(padded, reference) < 1e-5
    assert relative_difference(packed, reference) < 1e-5
    assert relative_difference(blank, one) < 1e-5


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    from rltrain.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("vl") / "model", family="qwen2_5_vl"))


def test_images_on_one_rank_alone_run_the_vision_tower_on_every_rank(ray_local, kept_learners, tiny_vl):
    # a group of 4 completions of a picture's prompt and a group of 4 of a text prompt, on
    # builtin:tiny-vl: in micro-batches of 4, rank 0 holds the pictures and rank 1 none. Under
    # ZeRO-3 the tower's forward gathers its weights, and a trained tower's backward reduces its
    # gradients, so rank 1 runs it too (on a blank picture whose features weigh nothing). Before,
    # rank 0 waited in the tower's gathers while rank 1 went on. The update is one learner's, the
    # tower's included
    from transformers import AutoTokenizer

    from rltrain.config import DataConfig
    from rltrain.data import shapes_rows, tokenize_prompts
    from rltrain.models.images import ImageInputs, is_vision_parameter

    tokenizer = AutoTokenizer.from_pretrained(tiny_vl)
    picture = tokenize_prompts(shapes_rows(1, seed=3), tokenizer, DataConfig(), ImageInputs(tiny_vl))[
        0
    ].token_ids
    text = tokenizer("what colour is the square?")["input_ids"]
    batch = batch_of([picture] * 4 + [text] * 4, [3, 12, 5, 8, 4, 10, 6, 7])
    assert batch.images[:4] == [picture.images] * 4 and batch.images[4:] == [None] * 4
    frozen, trained = {"freeze_vision": True}, {"freeze_vision": False}
    limits = {"max_prompt_tokens": len(picture)}
    configs = [
        config(1, 8, 0, model=trained, prefix_sharing=False, data=limits),
        config(2, 4, 3, model=trained, prefix_sharing=False, data=limits),  # padded
        config(2, 4, 3, model=trained, max_tokens_per_micro_batch=200, prefix_sharing=True, data=limits),
        config(2, 4, 2, model=trained, prefix_sharing=False, data=limits),
        config(1, 8, 0, model=frozen, prefix_sharing=False, data=limits),
        config(2, 4, 3, model=frozen, prefix_sharing="auto", data=limits),
    ]
    reference, *updates, frozen_reference, frozen_zero3 = updates_after_one_step(configs, tiny_vl, batch)
    assert any(v.abs().max() > 0 for k, v in reference.items() if is_vision_parameter(k))  # the tower trained
    for update in updates:
        assert relative_difference(update, reference) < 1e-5
    assert relative_difference(frozen_zero3, frozen_reference) < 1e-5
