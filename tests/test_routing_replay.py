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

from rltrain.batch import ROUTE_DTYPE, ROUTE_UNKNOWN, Completion, Segment, collate, extend_routes, nonempty
from rltrain.config import Config
from rltrain.diagnostics import layout_config, synthetic_rollouts
from rltrain.forward import sequence_logprobs
from rltrain.learner.route_rows import in_forward_order
from rltrain.models.routers import RouterTap, read_routers, replay_problem
from rltrain.models.tiny import build_tiny_model

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
    routes = torch.stack(chosen, 1).reshape(n, t, len(chosen), -1).to(torch.int16)
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
    # (read as logits alone, as Jamba's router: its block would choose, out of the replay's reach)
    assert replay_problem(moe) == "its router Qwen3MoeTopKRouter returns its logits alone (the experts are chosen outside it)"  # fmt: skip


def tiny_moe(kind: str, **more):
    """A tiny transformers MoE model of ``kind``'s router family, random weights (and, for the
    sigmoid routers, a random correction bias, which steers their choice)."""
    from transformers import DeepseekV3Config, Glm4MoeConfig, Qwen3MoeConfig

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    sigmoid = dict(first_k_dense_replace=0, n_shared_experts=1, norm_topk_prob=True, n_routed_experts=8)
    config = {
        # sigmoid scores, 4 groups of 2 experts (2 groups chosen), scaled by 2.5
        "deepseek_v3": lambda: DeepseekV3Config(**shape, **sigmoid, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                                q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                                                qk_nope_head_dim=8, v_head_dim=8),
        "glm4_moe": lambda: Glm4MoeConfig(**shape, **sigmoid, n_group=2, topk_group=1, routed_scaling_factor=1.5,
                                          head_dim=16),
        "qwen3_moe": lambda: Qwen3MoeConfig(**shape, head_dim=16, **{"num_experts": 8, **more}),
    }[kind]()  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    for router in RouterTap(model).routers:
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_()
    return model


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_replaying_a_sigmoid_routers_own_routes_runs_the_network_it_runs(kind):
    # DeepSeek-V3 and GLM-4-MoE weight their chosen experts by a sigmoid (renormalized, then times
    # routed_scaling_factor); their bias and group limit steer the choice only. Replaying the routes
    # a forward chose must give that forward's logits exactly (a softmax's weights gave others)
    model = tiny_moe(kind)
    assert replay_problem(model) is None
    tap = RouterTap(model)
    (_, read), *_ = read_routers(model)
    scale = {"deepseek_v3": 2.5, "glm4_moe": 1.5}[kind]
    assert str(read.scoring) == f"sigmoid renormalized over the chosen, times {scale:g}"
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), tap.capture() as (_, chosen):
        own = model(ids).logits
    tap.routes = torch.stack(chosen, 1)  # [N, L, k]: the routes the forward took
    with torch.no_grad(), tap.capture(measure=True):
        replayed = model(ids).logits
    assert tap.take_mismatch()[0] == 0  # every route agrees with the router's own
    assert torch.equal(replayed, own)


def test_a_router_whose_weights_no_replay_scoring_reproduces_is_refused_in_one_line():
    model = tiny_moe("qwen3_moe")
    router = model.model.layers[0].mlp.gate
    own = type(router).forward
    # squared: no activation times a constant gives it (doubled would be: softmax, times 2)
    router.forward = lambda hidden: (lambda out: (out[0], out[1] ** 2, out[2]))(own(router, hidden))
    problem = replay_problem(model)
    assert problem.startswith("its router Qwen3MoeTopKRouter weights the experts it chooses in a way routing "
                              "replay does not reproduce (a softmax or sigmoid of its logits, renormalized or "
                              "not, times a constant)")  # fmt: skip
    assert "\n" not in problem


def test_route_ids_past_255_replay_as_recorded_and_too_many_experts_are_refused():
    from transformers import Qwen3MoeConfig

    # 300 experts: ids 255 (uint8's "not recorded" before) and 299 (wrapped to 43 in uint8)
    model = tiny_moe("qwen3_moe", num_experts=300)
    assert replay_problem(model) is None
    routes = np.zeros((4, 2, 2), dtype=ROUTE_DTYPE)
    routes[:, :, 0], routes[:, :, 1] = 255, 299  # positions 0-3 (prompt and one sampled token)
    c = Completion()
    c.take(Segment([10, 11], [-0.1, -0.2], "", "stop", routes=routes))
    batch = collate([[1, 2, 3]], [c], torch.zeros(1), pad_id=0)
    tap = RouterTap(model)
    tap.routes = in_forward_order(batch.routes, batch.attention_mask, False, 1, 0, ROUTE_UNKNOWN).long()
    with torch.no_grad(), tap.capture() as (_, chosen):
        model(batch.input_ids)
    assert chosen[0][:4].tolist() == chosen[1][:4].tolist() == [[255, 299]] * 4  # as recorded
    with torch.device("meta"):  # (the architecture alone)
        huge = AutoModelForCausalLM.from_config(
            Qwen3MoeConfig(
                vocab_size=64,
                hidden_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                head_dim=16,
                num_experts=40_000,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
            )  # fmt: skip
        )
    assert replay_problem(huge) == "its 40000 experts are more than routing replay's expert ids hold (32768)"


def test_routes_travel_with_the_completion_and_land_on_their_tokens():
    # a prompt of 3 tokens, then two generation calls (a tool loop): the first ran positions 0-3
    # (prompt + 2 sampled, the last never run), the second, prompt + 2 + 1 inserted + 2 sampled,
    # positions 0-6; each position keeps its first routes
    first = np.full((4, 2, 2), 1, dtype=ROUTE_DTYPE)
    second = np.full((7, 2, 2), 2, dtype=ROUTE_DTYPE)
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
    unknown = ROUTE_UNKNOWN
    assert batch.routes[0, :, 0, 0].tolist() == [unknown, unknown, 1, 1, 1, 1, 2, 2, 2, unknown]
    assert (batch.routes[1] == ROUTE_UNKNOWN).all()  # recorded nowhere: the learner's own routes
    batch.validate()
    restored = Completion.from_state(c.state())  # a checkpoint's completions generated ahead
    assert np.array_equal(restored.routes, c.routes) and restored.routes.dtype == ROUTE_DTYPE
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
def test_learners_replay_the_engine_s_routes_in_every_layout(ray_local, kept_learners, models, layout):
    from rltrain.diagnostics import learners

    engine, learner = models
    batch = synthetic_rollouts()
    expected, routes = engine_pass(engine, batch)
    with learners(replay_config(**layout), learner) as group:
        replayed = group.per_token(batch.replace(routes=routes), own=True)
        reference = group.per_token(batch.replace(routes=routes))  # the frozen reference's forward
        own = group.per_token(batch, own=True)  # no routes: the learner's own routers
    scored = batch.response_mask.bool()
    assert (replayed - expected)[scored].abs().max() < 1e-4, layout
    assert (reference - expected)[scored].abs().max() < 1e-4, layout
    assert (own - expected)[scored].abs().max() > 1e-3, layout


def test_the_transformers_backend_records_the_routes_of_the_forward_that_scores_its_samples(tmp_path):
    # rollout.backend=hf with replay: each segment carries the experts of prompt + sampled tokens
    # but the last, which are the model's own top-2 on that sequence, position by position
    from rltrain.config import RolloutConfig
    from rltrain.rollout.hf_backend import HFBackend

    path = build_tiny_model(tmp_path / "moe", family="qwen3_moe")
    backend = HFBackend(str(path), RolloutConfig(routing_replay=True, max_new_tokens=6), [], False)
    prompt = [5, 17, 99, 3]
    (seg,) = backend.generate([prompt], [6], [0])
    sequence = prompt + seg.token_ids
    assert seg.routes.dtype == ROUTE_DTYPE and seg.routes.shape == (len(sequence) - 1, 2, 2)
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


def test_under_replay_the_gpu_engine_runs_eager_so_its_decode_steps_record_their_routes():
    # a CUDA graph replays kernels without Python: the capture hook would not run on decode steps
    from rltrain.config import RolloutConfig
    from rltrain.rollout.backends import runs_eager

    assert runs_eager(RolloutConfig(routing_replay=True), cuda=True)
    assert not runs_eager(RolloutConfig(routing_replay=False), cuda=True)  # graphs where nothing is recorded
    assert runs_eager(RolloutConfig(routing_replay=False), cuda=False)  # (no graphs on CPU)
