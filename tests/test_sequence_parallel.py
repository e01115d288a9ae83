"""Ulysses sequence parallelism on real gloo processes: a packed row split over 2 ranks gives the
single-rank packed log-probs and gradient; the owned positions count every token once."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_utils import free_port
from transformers import AutoModelForCausalLM

from rltrain.diagnostics import synthetic_rollouts
from rltrain.forward import RowLayout, attention, sequence_logprobs
from rltrain.forward import logprobs as forward_logprobs
from rltrain.forward.layouts import owned_positions, shard_packed_row
from rltrain.learner import sequence_parallel


def multi_document_batch(vocab: int = 256):
    # 5 sequences of 4-14 tokens, packed into one row of several documents; the row length is odd,
    # so the last rank's slice ends in padding
    batch = synthetic_rollouts(n=5, t=14, vocab=vocab, seed=7)
    return batch.input_ids, batch.attention_mask


def _rank_main(rank: int, sp: int, port: int, model_path: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=sp)
    try:
        torch.set_num_threads(1)
        name = sequence_parallel.use_group(dist.new_group(list(range(sp))))
        model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation=name)
        ids, attention = multi_document_batch(model.config.vocab_size)
        # this rank's share of the packed row, through the forward's own layout
        row = RowLayout(ids, attention, packed=True, shard=(sp, rank))
        logprobs, entropy = forward_logprobs(model, row, 0.8, with_entropy=True)
        logprobs.sum().backward()
        out[rank] = {
            "logprobs": logprobs.detach(),
            "entropy": entropy,
            "owned": owned_positions(attention, sp, rank),
            "grad": torch.cat([p.grad.reshape(-1) for p in model.parameters()]),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen2", "gpt-oss"])
def test_sequence_parallel_row_equals_the_single_rank_packed_row(family, tiny_model_path, tmp_path):
    # the tiny model's 2 query heads and 1 key/value head (repeated to 2); gpt-oss's 4 and 2, a
    # window of 6 and a sink per head (each rank's heads take their own)
    sp = 2
    if family == "gpt-oss":
        import families

        families.build("gpt-oss").save_pretrained(tmp_path / "gpt-oss")
    model_path = tiny_model_path if family == "qwen2" else str(tmp_path / "gpt-oss")
    out = mp.Manager().dict()
    mp.spawn(_rank_main, args=(sp, free_port(), model_path, out), nprocs=sp, join=True)

    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation=attention.register())
    ids, attention_mask = multi_document_batch(model.config.vocab_size)
    logprobs, entropy = sequence_logprobs(model, ids, attention_mask, 0.8, with_entropy=True, packed=True)
    logprobs.sum().backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    owned = torch.stack([out[r]["owned"] for r in range(sp)]).long()
    first_of_row = torch.zeros_like(attention_mask)
    first_of_row.view(-1)[attention_mask.view(-1).argmax()] = 1
    # every attended token but the row's very first is owned by exactly one rank
    assert torch.equal(owned.sum(0), attention_mask - first_of_row)
    # the ranks' log-probs add up to the single-rank row, and so do their gradient contributions
    torch.testing.assert_close(
        sum(out[r]["logprobs"] for r in range(sp)), logprobs.detach(), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(sum(out[r]["entropy"] for r in range(sp)), entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(out[r]["grad"] for r in range(sp)), grad, rtol=1e-5, atol=1e-5)


def test_shard_packed_row_pads_to_a_multiple_of_sp_with_a_document_of_its_own():
    ids, positions = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[0, 1, 2, 0, 1]])
    # 5 tokens over 2 ranks: 3 each, the sixth is padding with position 0 (a new document)
    assert [x.tolist() for x in shard_packed_row(ids, positions, 2, 0)] == [
        [[5, 6, 7]],
        [[0, 1, 2]],
    ]
    assert [x.tolist() for x in shard_packed_row(ids, positions, 2, 1)] == [
        [[8, 9, 0]],
        [[0, 1, 0]],
    ]
