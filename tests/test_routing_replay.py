"""Routing replay (rollout.routing_replay): the experts the engine chose travel with the rollout and
the learner's forward uses them. The learner here holds routers a hair off the engine's (as another
kernel's rounding would put them) on a model whose routers sit near ties, so its own top-k sends
some tokens elsewhere: without replay its log-probs differ from the engine's, with replay they are
the engine's, in padded, packed and sequence-parallel layouts on real Ray + DeepSpeed learners."""

import numpy as np
import pytest
import torch
from model_utils import nudged
from transformers import AutoModelForCausalLM

from rltrain.batch import ROUTE_UNKNOWN, Completion, Segment, collate, extend_routes, nonempty
from rltrain.config import Config
from rltrain.learner.routers import in_forward_order
from rltrain.loss.logprobs import sequence_logprobs
from rltrain.routing import RouterTap, replay_problem
from rltrain.run.diagnostics import layout_config, synthetic_rollouts
from rltrain.tiny_model import build_tiny_model

NEAR_TIES = 1e-3  # the routers' scale: experts' logits a few 1e-3 apart
NUDGE = 1e-4  # the learner's routers differ from the engine's by this much (noise per weight)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str]:
    """(the engine's model, the learner's: the same with its routers nudged)."""
    root = tmp_path_factory.mktemp("replay")
    engine = build_tiny_model(root / "engine", family="qwen3_moe", router_std=NEAR_TIES)
    nudged(engine, NUDGE, seed=1, suffix="mlp.gate.weight").save_pretrained(root / "learner")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (root / "learner" / f).write_bytes((engine / f).read_bytes())
    return str(engine), str(root / "learner")


def engine_pass(path: str, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's log-probs ``[N, T]`` and routes ``[N, T, L, k]`` (UNKNOWN on padding) of a
    padded batch, recorded by the router hooks as the transformers backend records them."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tap = RouterTap(model)
    with torch.no_grad(), tap.capture() as (_, chosen):
        logprobs, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
    n, t = batch.input_ids.shape
    routes = torch.stack(chosen, 1).reshape(n, t, len(chosen), -1).to(torch.uint8)
    routes[~batch.attention_mask.bool()] = ROUTE_UNKNOWN
    return logprobs, routes


def test_replay_gives_the_engine_s_log_probs_where_the_learner_s_own_routes_differ(models):
    engine, learner = models
    batch = synthetic_rollouts()
    expected, routes = engine_pass(engine, batch)
    model = AutoModelForCausalLM.from_pretrained(learner).eval()
    tap = RouterTap(model)
    scored = batch.response_mask.bool()
    with torch.no_grad():
        own, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
        tap.routes = in_forward_order(routes, batch.attention_mask, False, 1, 0, ROUTE_UNKNOWN).long()
        with tap.capture(measure=True) as (_, chosen):
            replayed, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask)
    assert (own - expected)[scored].abs().max() > 1e-3  # some tokens took other experts
    assert (replayed - expected)[scored].abs().max() < 1e-4
    elsewhere, rows = tap.take_mismatch().tolist()
    # every attended token in both layers was replayed; some the learner's router would send elsewhere
    assert rows == batch.attention_mask.sum().item() * 2 and 0 < elsewhere < rows
    # the chosen experts are the replayed ones
    assert torch.equal(chosen[0][batch.attention_mask.reshape(-1).bool()],
                       routes[:, :, 0][batch.attention_mask.bool()].long())  # fmt: skip


def test_replayed_scores_carry_the_router_s_gradient(models):
    _, learner = models
    model = AutoModelForCausalLM.from_pretrained(learner)
    tap = RouterTap(model)
    ids = torch.tensor([[5, 9, 13, 2]])
    tap.routes = torch.tensor([[[0, 1], [2, 3]]] * 4)  # experts 0,1 in layer 0 and 2,3 in layer 1
    logprobs, _ = sequence_logprobs(model, ids, torch.ones_like(ids))
    logprobs.sum().backward()
    gate = model.model.layers[0].mlp.gate.weight.grad
    assert gate is not None and gate.abs().sum() > 0


def test_a_router_the_replay_cannot_drive_is_named(models):
    _, learner = models
    dense = AutoModelForCausalLM.from_pretrained(build_tiny_model(f"{learner}-dense"))
    assert replay_problem(dense) == "it is not a mixture of experts (no router)"
    moe = AutoModelForCausalLM.from_pretrained(learner)
    assert replay_problem(moe) is None
    router = moe.model.layers[0].mlp.gate
    router.forward = lambda hidden: torch.nn.functional.linear(hidden, router.weight)  # logits only
    assert replay_problem(moe) == "its router Qwen3MoeTopKRouter does not return transformers' top-k (logits, scores, indices)"  # fmt: skip


def test_routes_travel_with_the_completion_and_land_on_their_tokens():
    # a prompt of 3 tokens, then two generation calls (a tool loop): the first ran positions 0-3
    # (prompt + 2 sampled, the last never run), the second, prompt + 2 + 1 inserted + 2 sampled,
    # positions 0-6; each position keeps its first routes
    first = np.full((4, 2, 2), 1, dtype=np.uint8)
    second = np.full((7, 2, 2), 2, dtype=np.uint8)
    c = Completion()
    c.take(Segment([10, 11], [-0.1, -0.2], "", "stop", routes=first))
    c.insert([12])
    c.take(Segment([13, 14], [-0.3, -0.4], "", "stop", routes=second))
    assert c.routes[:, 0, 0].tolist() == [1, 1, 1, 1, 2, 2, 2]
    assert extend_routes(None, second) is second and extend_routes(first, None) is first
    # collated beside a longer prompt: left-padded by 2, the last token's column unknown
    batch = collate([[1, 2, 3], [4, 5, 6, 7, 8]], [c, Completion(token_ids=[9], logprobs=[0.0], tool_mask=[1])],
                    torch.zeros(2), pad_id=0)  # fmt: skip
    assert batch.routes.shape == (2, 5 + 5, 2, 2)
    assert batch.routes[0, :, 0, 0].tolist() == [255, 255, 1, 1, 1, 1, 2, 2, 2, 255]
    assert (batch.routes[1] == ROUTE_UNKNOWN).all()  # recorded nowhere: the learner's own routes
    batch.validate()
    restored = Completion.from_state(c.state())  # a checkpoint's completions generated ahead
    assert np.array_equal(restored.routes, c.routes) and restored.routes.dtype == np.uint8
    blank = nonempty(batch.select(torch.tensor([], dtype=torch.long)))
    assert blank.routes.shape == (1, 2, 2, 2) and (blank.routes == ROUTE_UNKNOWN).all()


def test_routes_in_packed_and_sequence_parallel_order():
    # two sequences, left-padded: [pad a0 a1] and [b0 b1 b2]; packed: a0 a1 b0 b1 b2; over 2 ranks
    # of a row padded to 6: rank 0 a0 a1 b0, rank 1 b1 b2 <fill>
    values = torch.tensor([[0, 1, 2], [3, 4, 5]])
    attention = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert in_forward_order(values, attention, False, 1, 0, -1).tolist() == [0, 1, 2, 3, 4, 5]
    assert in_forward_order(values, attention, True, 1, 0, -1).tolist() == [1, 2, 3, 4, 5]
    assert in_forward_order(values, attention, True, 2, 0, -1).tolist() == [1, 2, 3]
    assert in_forward_order(values, attention, True, 2, 1, -1).tolist() == [4, 5, -1]


def replay_config(*args, **kwargs) -> Config:
    """A layout with routing replay and a KL term (so the learners hold a frozen reference too)."""
    raw = layout_config(*args, loss={"kl_beta": 0.01}, **kwargs).model_dump()
    raw["rollout"]["routing_replay"] = True
    return Config.model_validate(raw)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(dict(num_learners=2, micro_batch_size=3, zero_stage=2), id="padded"),
        pytest.param(
            dict(num_learners=2, micro_batch_size=3, zero_stage=3, max_tokens_per_micro_batch=30),
            id="packed-zero3",
        ),  # fmt: skip
        pytest.param(
            dict(
                num_learners=2,
                micro_batch_size=3,
                zero_stage=1,
                max_tokens_per_micro_batch=30,
                sequence_parallel_size=2,
            ),
            id="sp2-packed",
        ),  # fmt: skip
    ],
)
def test_learners_replay_the_engine_s_routes_in_every_layout(ray_local, models, layout):
    from rltrain.learner.group import LearnerGroup

    engine, learner = models
    batch = synthetic_rollouts()
    expected, routes = engine_pass(engine, batch)
    group = LearnerGroup(replay_config(**layout), learner, total_optimizer_steps=1)
    try:
        replayed = group.per_token(batch.replace(routes=routes), own=True)
        reference = group.per_token(batch.replace(routes=routes))  # the frozen reference's forward
        own = group.per_token(batch, own=True)  # no routes: the learner's own routers
    finally:
        group.shutdown()
    scored = batch.response_mask.bool()
    assert (replayed - expected)[scored].abs().max() < 1e-4, layout
    assert (reference - expected)[scored].abs().max() < 1e-4, layout
    assert (own - expected)[scored].abs().max() > 1e-3, layout


def test_the_transformers_backend_records_the_routes_of_the_forward_that_scores_its_samples(tmp_path):
    # rollout.backend=hf with replay: each segment carries the experts of prompt + sampled tokens
    # but the last, which are the model's own top-2 on that sequence, position by position
    from rltrain.config import RolloutConfig
    from rltrain.rollout.backends import HFBackend

    path = build_tiny_model(tmp_path / "moe", family="qwen3_moe")
    backend = HFBackend(str(path), RolloutConfig(routing_replay=True, max_new_tokens=6), [], False)
    prompt = [5, 17, 99, 3]
    (seg,) = backend.generate([prompt], [6], [0])
    sequence = prompt + seg.token_ids
    assert seg.routes.dtype == np.uint8 and seg.routes.shape == (len(sequence) - 1, 2, 2)
    tap = RouterTap(backend.model)
    with torch.no_grad(), tap.capture() as (_, chosen):
        backend.model(torch.tensor([sequence]))
    own = torch.stack(chosen, 1)[:-1].sort(-1).values
    assert torch.equal(torch.tensor(seg.routes).long().sort(-1).values, own)
    assert (
        HFBackend(str(path), RolloutConfig(max_new_tokens=6), [], False)
        .generate([prompt], [6], [0])[0]
        .routes
        is None
    )
