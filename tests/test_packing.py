"""Padding-free packed micro-batches: the packed forward, the token-budget planner, the config keys."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rltrain.batch import TrainBatch
from rltrain.config import ConfigError, load_config
from rltrain.diagnostics import synthetic_rollouts
from rltrain.forward import attention, pack_sequences, packed_forward, sequence_logprobs
from rltrain.forward.attention import document_attention
from rltrain.masked_mean import group_token_totals
from rltrain.plan import plan_packed_micro_batches


def ragged_batch(seed: int = 0) -> TrainBatch:
    # 6 sequences with left-padded prompts and right-padded completions, lengths 4..14
    return synthetic_rollouts(n=6, t=14, seed=seed)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_model_path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=request.param).eval()


def per_sequence_logits(model, batch: TrainBatch) -> list[torch.Tensor]:
    """Each sequence alone, unpadded: the reference a packed row must reproduce."""
    out = []
    for ids, keep in zip(batch.input_ids, batch.attention_mask.bool()):
        with torch.no_grad():
            out.append(model(input_ids=ids[keep][None]).logits[0])
    return out


def test_pack_sequences_restarts_positions_per_sequence():
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 0, 0], [0, 0, 3, 0]])
    attention = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 0]])
    ids_1L, positions_1L = pack_sequences(ids, attention)
    assert ids_1L.tolist() == [[5, 6, 7, 8, 9, 3]]
    assert positions_1L.tolist() == [[0, 1, 2, 0, 1, 0]]


def test_packed_logits_equal_per_sequence_logits(model):
    batch = ragged_batch()
    ids_1L, positions_1L = pack_sequences(batch.input_ids, batch.attention_mask)
    with torch.no_grad():
        packed = packed_forward(model, ids_1L, positions_1L).logits[0]
    reference = torch.cat(per_sequence_logits(model, batch))
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("leak", ["all-ones attention mask", "KV cache"])
def test_a_mask_or_cache_lets_documents_attend_to_each_other(model, leak):
    # the trap the packed forward avoids: transformers then builds one causal mask over the row
    batch = ragged_batch()
    ids_1L, positions_1L = pack_sequences(batch.input_ids, batch.attention_mask)
    kwargs = {"attention_mask": torch.ones_like(ids_1L)} if leak == "all-ones attention mask" else {}
    with torch.no_grad():
        leaked = model(input_ids=ids_1L, position_ids=positions_1L, use_cache=True, **kwargs).logits[0]
    reference = torch.cat(per_sequence_logits(model, batch))
    first = len(per_sequence_logits(model, batch)[0])
    # the first document sees nothing before it either way; every later one sees its predecessors
    torch.testing.assert_close(leaked[:first], reference[:first], rtol=1e-5, atol=1e-5)
    assert (leaked[first:] - reference[first:]).abs().max() > 1e-2


def test_packed_logprobs_entropy_and_gradient_equal_the_padded_ones(tiny_model_path):
    batch = ragged_batch(seed=2)
    first = batch.attention_mask.argmax(-1)
    # every token with a prefix (a sequence's first token has none: the padded layout predicts it
    # from padding, the packed one gives it 0; it is a prompt token, never a loss token)
    keep = batch.attention_mask.bool()
    keep[torch.arange(len(batch)), first] = False
    results = {}
    for packed in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
        logprobs, entropy = sequence_logprobs(
            model, batch.input_ids, batch.attention_mask, 0.7, with_entropy=True, packed=packed
        )
        results[f"first{packed}"] = logprobs[torch.arange(len(batch)), first]
        (logprobs * keep).sum().backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        results[packed] = (logprobs * keep, entropy * keep, grad)
    for padded, packed in zip(results[False], results[True]):
        torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    # no token is predicted across a document boundary: every sequence's first token gets 0
    assert (results["firstTrue"] == 0).all()


LENGTHS = torch.tensor([5, 40, 3, 17, 33, 8, 1, 60, 22, 9, 12, 30])


@pytest.mark.parametrize(
    ("world", "mini", "budget"), [(1, 1, 64), (2, 1, 40), (2, 3, 64), (3, 2, 100), (4, 1, 7)]
)
def test_packed_plan_keeps_every_sequence_once_within_budget_and_in_lockstep(world, mini, budget):
    plan = plan_packed_micro_batches(LENGTHS, world, mini, budget)
    seen = sorted(i for rank in plan.groups for group in rank for mb in group for i in mb.tolist())
    assert seen == list(range(len(LENGTHS)))  # nothing dropped, nothing twice, nothing split
    shape = plan.micro_batches_per_group()
    assert len(shape) == mini
    assert all([len(group) for group in rank] == shape for rank in plan.groups)  # same collectives everywhere
    for rank in plan.groups:
        for group in rank:
            for mb in group:
                # within budget, except a sequence longer than the budget, which is alone
                assert LENGTHS[mb].sum() <= budget or len(mb) == 1
    assert plan.oversized == int((LENGTHS > budget).sum())


def test_packed_plan_balances_tokens_over_ranks():
    # 12 sequences, 240 tokens, 2 ranks: longest first to the lighter rank gives 120 / 120
    # (60->r0, 40->r1, 33->r1, 30->r0, 22->r1, 17->r0, 12->r0, 9->r1, 8->r1, 5->r1, 3->r0, 1->r0)
    plan = plan_packed_micro_batches(LENGTHS, 2, 1, 240)
    loads = [sum(int(LENGTHS[mb].sum()) for mb in rank[0]) for rank in plan.groups]
    assert loads == [120, 120]
    assert plan.micro_batches_per_group() == [1]  # each share fits one micro-batch of 240


def test_packed_plan_pads_the_lighter_rank_with_empty_micro_batches():
    # lengths 10, 10, 10 on 2 ranks with a budget of 10: rank 0 gets two micro-batches, rank 1 one
    plan = plan_packed_micro_batches(torch.tensor([10, 10, 10]), 2, 1, 10)
    assert [len(mb) for mb in plan.groups[0][0]] == [1, 1]
    assert [len(mb) for mb in plan.groups[1][0]] == [1, 0]


def test_token_totals_take_a_micro_batch_count_per_group():
    # groups of 2 and 1 micro-batches: (3 + 1) and 2 loss tokens
    masks = [torch.tensor([[1, 1, 1]]), torch.tensor([[0, 1, 0]]), torch.tensor([[1, 0, 1]])]
    assert group_token_totals(masks, [2, 1]).tolist() == [4.0, 2.0]
    with pytest.raises(ValueError, match="sum to the 3 masks"):
        group_token_totals(masks, [1, 1])


def test_trim_drops_columns_no_sequence_attends_to():
    batch = ragged_batch().select(torch.tensor([1, 4]))
    trimmed = batch.trim()
    used = batch.attention_mask.bool().any(0).nonzero().flatten()
    assert trimmed.input_ids.shape[1] == int(used[-1] - used[0] + 1)
    assert trimmed.attention_mask.sum() == batch.attention_mask.sum()
    assert trimmed.response_mask.sum() == batch.response_mask.sum()
    trimmed.validate()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["learner.max_tokens_per_micro_batch=100"],
            "learner.max_tokens_per_micro_batch=100 cannot hold one sequence of up to 208",
        ),
        (["learner.packing=false", "learner.max_tokens_per_micro_batch=4096"], "needs learner.packing=true"),
        (["learner.max_tokens_per_micro_batch=0"], "learner.max_tokens_per_micro_batch: got 0"),
    ],
)
def test_bad_token_budget_is_one_line(overrides, expected):
    with pytest.raises(ConfigError) as error:
        load_config("configs/cpu_demo.yaml", overrides)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_default_budget_is_the_padded_worst_case():
    config = load_config("configs/cpu_demo.yaml", ["learner.micro_batch_size=4"])
    # 4 sequences x (128 prompt + 80 completion tokens)
    assert config.learner.packing and config.token_budget(config.learner) == 4 * (128 + 80)


def test_document_attention_equals_attention_under_a_block_diagonal_causal_mask():
    # two documents of 3 and 2 tokens, then one token alone; 2 query heads sharing 1 key/value head
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 6, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    allowed = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ]
    ).bool()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.expand_as(q), v.expand_as(q), attn_mask=allowed
    )
    torch.testing.assert_close(document_attention(q, k, v, positions), expected)


def test_the_packed_attention_function_gives_the_per_sequence_logits(tiny_model_path):
    name = attention.register()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation=name).eval()
    batch = ragged_batch(seed=3)
    ids_1L, positions_1L = pack_sequences(batch.input_ids, batch.attention_mask)
    with torch.no_grad():
        packed = packed_forward(model, ids_1L, positions_1L).logits[0]
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_path, attn_implementation="sdpa").eval()
    reference = torch.cat(per_sequence_logits(sdpa, batch))
    torch.testing.assert_close(packed, reference, rtol=1e-5, atol=1e-5)
