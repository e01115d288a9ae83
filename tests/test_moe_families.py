"""Every mixture-of-experts family transformers ships (tests/families.py builds each tiny from its
config): its routers read by what they return (rltrain.models.routers), the load-balancing loss from
what they read equal to transformers' own, routing replay running the network the routes ran, every
layout the family contract allows exact against each sequence alone under ``eager``; or a refusal
in one line naming what cannot read it. No list of families: a family transformers adds is in."""

import families
import pytest
import torch

from rltrain.forward import sequence_logprobs
from rltrain.loss.moe import expert_counts, load_balancing_loss
from rltrain.models.families import layout_problem, needs
from rltrain.models.routers import RouterTap, moe_problem, own_aux_loss, replay_problem

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
MOE = sorted(families.MOE)
# routers no kind of output reads: one line for every feature that would read them
UNREAD = {"doge": "its router DogeCDMoE returns (float [1, 64, 64], float [2, 64, 4]): its logits are not one an expert for each row"}  # fmt: skip
# routers read but whose weighting replay cannot reproduce, and why
NO_REPLAY = {
    "inkling_text": "weights the experts it chooses in a way routing replay does not reproduce",  # shared gammas
    "phimoe": "weights the experts it chooses in a way routing replay does not reproduce",  # sparse mixer
    "zaya": "weights the experts it chooses in a way routing replay does not reproduce",  # a skip expert
    "jamba": "returns its logits alone (the experts are chosen outside it)",  # a linear layer
    "dbrx": "returns its logits alone (the experts are chosen outside it)",
}
# a forward whose rows depend on one another (Doge's router views [B, S, 2K] as [2, B S, K]): no batched
# layout is each sequence alone; the run's start-up check stops it (tests/test_moe.py)
BATCH_DEPENDENT = {"doge"}


def ids_and_mask():
    torch.manual_seed(0)
    ids = torch.randint(3, families.VOCAB, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # (a left-padded prompt)
    return ids, mask


@pytest.mark.parametrize("model_type", MOE)
def test_a_moe_familys_routers_are_read_by_what_they_return_or_refused_in_one_line(model_type):
    model = families.build(model_type)
    if model_type in UNREAD:
        for feature in ("metrics", "aux", "replay"):
            assert moe_problem(model, feature) == UNREAD[model_type]
        assert RouterTap(model).routers == []  # its metrics off, its run's start refused where asked
        return
    tap = RouterTap(model)
    assert tap.routers and tap.problem is None
    ids, mask = ids_and_mask()
    rows = mask.reshape(-1).bool()
    with torch.no_grad(), tap.capture() as (logits, chosen):
        own, _ = sequence_logprobs(model, ids, mask)
    assert len(logits) == len(chosen) == len(tap.routers)
    counts = expert_counts(logits, rows, tap.top_k, chosen)
    aux = load_balancing_loss(logits, rows, counts, tap.top_k)
    # Switch Transformer's loss by hand from the logits and the experts chosen, padding left out:
    # E * sum_e (assignments_e / rows) * (probability mass_e / rows), rows = tokens x routers (a
    # balanced top-2 of 4 reads 4 * 4 * (2/4 * 1/4) = 2)
    probs = torch.cat([torch.softmax(x[rows].double(), -1) for x in logits])
    picked = torch.cat([c[rows] for c in chosen])
    f = torch.bincount(picked.reshape(-1), minlength=tap.num_experts).double() / len(probs)
    by_hand = tap.num_experts * (f * probs.mean(0)).sum()
    assert aux.item() == pytest.approx(by_hand.item(), rel=1e-5)
    # transformers' own loss, where the family adds one, counts the top-k of the logits: the same
    # where the router chooses by them (not past a score-correction bias) and records each once; on
    # rows without padding (a recurrent layer of its own reads left padding into the sequence)
    topk_of_logits = all(torch.equal(c.sort(-1).values, x.topk(tap.top_k).indices.sort(-1).values)
                         for c, x in zip(chosen, logits))  # fmt: skip
    if own_aux_loss(model) and topk_of_logits:
        with torch.no_grad(), tap.capture() as (whole, whole_chosen):
            out = model(input_ids=ids[1:], output_router_logits=True, use_cache=False)
        all_rows = torch.ones(ids[1:].numel(), dtype=torch.bool)
        ours = load_balancing_loss(
            whole, all_rows, expert_counts(whole, all_rows, tap.top_k, whole_chosen), tap.top_k
        )
        if out.aux_loss is not None and len(out.router_logits) == len(whole):
            assert ours.item() == pytest.approx(float(out.aux_loss), rel=1e-5)
    if model_type in NO_REPLAY:
        problem = replay_problem(model)
        assert NO_REPLAY[model_type] in problem and "\n" not in problem
        return
    assert replay_problem(model) is None
    tap.routes = torch.stack(chosen, 1)  # [N, L, k]: replaying the routes the forward took
    with torch.no_grad(), tap.capture(measure=True):
        replayed, _ = sequence_logprobs(model, ids, mask)
    assert (replayed - own)[mask.bool()].abs().max() <= 1e-6
    assert tap.take_mismatch()[0] == 0
    g = torch.Generator().manual_seed(1)  # other routes: another network, the routers still learn
    tap.routes = torch.stack([torch.randperm(tap.num_experts, generator=g)[: tap.top_k]
                              for _ in range(rows.numel() * len(logits))]).view(tap.routes.shape)  # fmt: skip
    other, _ = sequence_logprobs(model, ids, mask)
    other.sum().backward()
    assert (other.detach() - own)[mask.bool()].abs().max() > 1e-4
    assert all(
        any(p.grad is not None and p.grad.abs().sum() > 0 for p in r.parameters()) for r in tap.routers
    )


@pytest.mark.parametrize("model_type", MOE)
def test_a_moe_family_is_exact_in_every_layout_its_contract_allows_and_refused_in_one_line_elsewhere(
    model_type,
):
    # each completion's log-prob and every parameter's gradient against each sequence alone, in fp32;
    # where a recurrent layer's scan rounds apart on other chunk boundaries, again in float64
    model_needs = needs(families.config(model_type), families.build(model_type))
    refused = layout_problem(model_needs, "learner", packing=True, sharing=True)
    layouts = ("padded",) if refused else ("padded", "packed", "tree")
    if refused:
        assert "learner.packing=false" in refused and "\n" not in refused
        assert layout_problem(model_needs, "learner", packing=False, sharing="auto") is None
    gaps = families.worst_differences(model_type, layouts=layouts)
    print(model_type, gaps, refused)
    if model_type in BATCH_DEPENDENT:
        assert gaps["padded"][0] > 1e-3
        return
    if model_needs.recurrent and max(grad for _, grad in gaps.values()) > 1e-5:
        with families.float64_scans(model_type):
            gaps = families.worst_differences(model_type, layouts=layouts, dtype=torch.float64)
        print(model_type, "float64", gaps)
    for layout, (logprob_gap, grad_gap) in gaps.items():
        assert logprob_gap <= 1e-5 and grad_gap <= 1e-5, (layout, logprob_gap, grad_gap)
