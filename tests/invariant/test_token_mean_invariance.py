"""The same tokens, split differently, give the same gradient in ``token`` mode; the naive mean does not.

Single process (micro-batches) and real processes on gloo (ranks x micro-batches), with uneven
token counts, tool masks, an all-masked sequence and an empty micro-batch, for every aggregation
(token mean, per-sequence mean, per-sequence sum, per-sequence sum over a constant).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_utils import count_collectives, free_port
from toy_policy import flat_grad, make_policy, make_rollouts, micro_batch_loss, reference_grad, relative_error

from rltrain.masked_mean import AGGREGATIONS, step_totals

N = 12
# micro-batch boundaries over the 12 sequences of one optimizer step, for each number of splits;
# deliberately uneven (the all-masked sequence 0 is alone in the 4-way split)
SPLITS = {1: [12], 2: [3, 9], 4: [1, 5, 2, 4]}


def _accumulate(split_sizes, mode, aggregation="token-mean"):
    rollouts = make_rollouts(N)
    policy = make_policy()
    chunks = [rollouts.select(idx) for idx in torch.arange(N).split(split_sizes)]
    totals = step_totals([c.mask for c in chunks], len(chunks), [c.tool_mask for c in chunks])
    for chunk in chunks:
        if mode == "token":  # no /accumulation_steps
            micro_batch_loss(policy, chunk, totals.denominator(0, aggregation, 1), aggregation).backward()
        else:
            (micro_batch_loss(policy, chunk, None, aggregation) / len(chunks)).backward()
    return flat_grad(policy)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_token_mode_is_invariant_to_micro_batching(splits, aggregation):
    err = relative_error(
        _accumulate(SPLITS[splits], "token", aggregation), reference_grad(make_rollouts(N), aggregation)
    )
    assert err < 1e-6, err


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("splits", [2, 4])
def test_per_micro_batch_mean_is_not_invariant(splits, aggregation):
    err = relative_error(
        _accumulate(SPLITS[splits], "mean", aggregation), reference_grad(make_rollouts(N), aggregation)
    )
    print(f"naive per-micro-batch {aggregation}, {splits} splits: relative gradient error {err:.3f}")
    assert err > 0.05, err


# ---------------------------------------------------------------- real processes on gloo

ACC = 3
GROUPS = 2  # two optimizer steps: sequences 0..11 and 12..23
# per group, the 12 sequences cut into world * ACC micro-batches, uneven, one of them empty
CUTS = {2: [1, 4, 0, 2, 3, 2], 3: [2, 0, 1, 3, 1, 2, 1, 1, 1]}


def _rank_main(rank: int, world: int, port: int, mode: str, out: dict) -> None:
    """Every aggregation with one set of totals: ``out[(aggregation, rank, group)]`` is the error."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        all_rollouts = make_rollouts(N * GROUPS)
        cuts = CUTS[world]
        my_chunks = []
        for g in range(GROUPS):
            group = all_rollouts.select(torch.arange(g * N, (g + 1) * N))
            pieces = [group.select(idx) for idx in torch.arange(N).split(cuts)]
            my_chunks += pieces[rank * ACC : (rank + 1) * ACC]

        with count_collectives() as calls:
            totals = step_totals([c.mask for c in my_chunks], ACC, [c.tool_mask for c in my_chunks])
        assert calls == {"all_reduce": 1}, calls  # one collective: tokens and sequences, both groups

        for aggregation in AGGREGATIONS:
            for g in range(GROUPS):
                policy = make_policy()
                for chunk in my_chunks[g * ACC : (g + 1) * ACC]:
                    if mode == "token":
                        # the DP-size factor cancels the gradient averaging below (as DDP/DeepSpeed do)
                        loss = micro_batch_loss(
                            policy, chunk, totals.denominator(g, aggregation, world), aggregation
                        )
                    else:
                        loss = micro_batch_loss(policy, chunk, None, aggregation) / ACC
                    loss.backward()
                grad = flat_grad(policy)
                dist.all_reduce(grad)
                grad /= world  # data-parallel averaging
                expected = reference_grad(all_rollouts.select(torch.arange(g * N, (g + 1) * N)), aggregation)
                out[(aggregation, rank, g)] = relative_error(grad, expected)
    finally:
        dist.destroy_process_group()


def _run(world: int, mode: str) -> dict:
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank_main, args=(world, free_port(), mode, out), nprocs=world, join=True)
        return dict(out)


@pytest.mark.parametrize("world", [2, 3])
def test_token_mode_matches_single_process_across_ranks(world):
    errors = _run(world, "token")
    assert len(errors) == len(AGGREGATIONS) * world * GROUPS
    assert max(errors.values()) < 1e-5, errors


def test_per_micro_batch_mean_across_ranks_is_wrong():
    errors = _run(2, "mean")
    print(f"naive mean over 2 ranks x {ACC} micro-batches: relative gradient errors {errors}")
    for aggregation in AGGREGATIONS:  # every rank and group of every mode is visibly off
        assert min(e for (a, _, _), e in errors.items() if a == aggregation) > 0.05, (aggregation, errors)
