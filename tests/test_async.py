"""Bounded staleness and in-flight weight updates: per-token versions, stale groups dropped and
counted, chunked generation that takes new weights between chunks (a real vLLM engine)."""

import math
import random
import time

import pytest
import torch

from rltrain.batch import Completion, Segment
from rltrain.data import Prompt
from rltrain.rollout.inflight import continuation_seed, generate_in_chunks
from rltrain.run.scoring import ScoredGroups, drop_stale


def completion(versions: list[int], tool_mask: list[int] | None = None) -> Completion:
    mask = tool_mask or [1] * len(versions)
    return Completion(token_ids=[7] * len(versions), logprobs=[0.0] * len(versions), tool_mask=mask,
                      versions=versions)  # fmt: skip


def test_groups_with_a_token_past_max_staleness_are_dropped_whole_and_counted():
    # learners at version 5, max_staleness 1, groups of 2
    completions = [
        completion([5, 5]), completion([4, 5]),  # group 0: ages 0,0 | 1,0: kept
        completion([4, 4]), completion([3, 5]),  # group 1: the 3 is 2 versions old: dropped whole
        completion([3, 5], tool_mask=[0, 1]), completion([5]),  # group 2: the 3 is a tool token: kept
    ]  # fmt: skip
    scored = ScoredGroups([Prompt(0, [1], "a"), Prompt(1, [2], "b"), Prompt(2, [3], "c")], completions,
                          torch.arange(6.0), {"reward/mean": 2.5})  # fmt: skip
    kept = drop_stale(scored, version=5, max_staleness=1, group_size=2)
    assert [p.answer for p in kept.prompts] == ["a", "c"]
    assert kept.rewards.tolist() == [0.0, 1.0, 4.0, 5.0]
    # sampled tokens' ages: 0,0 | 1,0 | 1,1 | 2,0 | 0 | 0 -> 5 / 10 tokens
    assert kept.metrics["rollout/staleness_mean"] == pytest.approx(5 / 10)
    assert kept.metrics["rollout/staleness_max"] == 2
    assert kept.metrics["rollout/stale_dropped"] == 2
    assert kept.metrics["reward/mean"] == 2.5  # the scoring's metrics stay
    fresh = drop_stale(scored, version=5, max_staleness=2, group_size=2)
    assert len(fresh.completions) == 6 and fresh.metrics["rollout/stale_dropped"] == 0


class FakeEngine:
    """A 'model' that samples token ids 1..9 from a generator seeded by the request's seed, writes
    its version into each log-prob, and ends a request at token 0 (its EOS)."""

    def __init__(self, eos_after: dict[int, int] | None = None):
        self.version, self.calls, self.eos_after = 0, [], eos_after or {}

    def __call__(self, prompts, max_tokens, seeds):
        self.calls.append((len(prompts), list(max_tokens), list(seeds)))
        out = []
        for prompt, m, seed in zip(prompts, max_tokens, seeds):
            rng = random.Random(seed)
            ids, finish = [], "length"
            for _ in range(m):
                ids.append(rng.randint(1, 9))
                if len(prompt) - 1 + len(ids) == self.eos_after.get(prompt[0], -1):
                    ids[-1], finish = 0, "stop"
                    break
            out.append(Segment(ids, [float(self.version)] * len(ids), "", finish, [self.version] * len(ids)))
        self.version += 1  # new weights arrive between every two chunks
        return out


def decode(ids: list[int]) -> str:
    return "".join(map(str, ids))


def test_chunks_carry_their_own_version_and_a_first_chunk_samples_as_one_call_would():
    engine = FakeEngine(eos_after={2: 5})  # the request whose prompt starts with 2 ends at its 5th token
    segs = generate_in_chunks(engine, [[1], [2]], [10, 10], [11, 22], chunk=4, stop=[], decode=decode)
    # request 1: 10 tokens in chunks of 4, 4, 2 under versions 0, 1, 2; request 2: 4 + its EOS
    assert segs[0].versions == [0] * 4 + [1] * 4 + [2] * 2 and segs[0].finish_reason == "length"
    assert (
        segs[1].versions == [0] * 4 + [1] and segs[1].finish_reason == "stop" and segs[1].token_ids[-1] == 0
    )
    assert [s.logprobs for s in segs] == [[float(v) for v in s.versions] for s in segs]
    assert engine.calls[0] == (2, [4, 4], [11, 22])  # first chunk: the requests' own seeds
    assert engine.calls[1] == (2, [4, 4], [continuation_seed(11, 4), continuation_seed(22, 4)])
    assert engine.calls[2] == (1, [2], [continuation_seed(11, 8)])
    assert segs[0].text == decode(segs[0].token_ids)
    # the first chunk is exactly the one-call sample with the request's seed
    whole = FakeEngine()([[1]], [10], [11])[0]
    assert segs[0].token_ids[:4] == whole.token_ids[:4]
    assert len({continuation_seed(11, n) for n in range(0, 400, 4)}) == 100  # a fresh stream per chunk


def test_a_stop_string_split_over_two_chunks_ends_the_segment_where_it_completes():
    plain = generate_in_chunks(FakeEngine(), [[1]], [6], [5], chunk=3, stop=[], decode=decode)[0]
    engine = FakeEngine()  # the same samples again, now with a stop string over tokens 3-5:
    stop = decode(plain.token_ids[2:5])  # chunk 1 holds its first token, chunk 2 the rest
    segs = generate_in_chunks(engine, [[1]], [6], [5], chunk=3, stop=[stop], decode=decode)
    assert segs[0].finish_reason == "stop"
    assert decode(segs[0].token_ids).endswith(stop) and stop not in decode(segs[0].token_ids[:-1])
    assert len(segs[0].versions) == len(segs[0].logprobs) == len(segs[0].token_ids) <= 5


@pytest.mark.slow
def test_inflight_weights_reach_a_vllm_engine_between_steps_and_every_token_keeps_its_version_and_routes(
    ray_local, tmp_path
):
    # a mixture of experts with routing replay: the engine also records the experts of every
    # position it runs, and they stay aligned with the tokens through the update in flight
    import ray
    from model_utils import nudged
    from transformers import AutoModelForCausalLM

    from rltrain.batch import ROUTE_UNKNOWN
    from rltrain.config import Config
    from rltrain.forward import sequence_logprobs
    from rltrain.models.routers import RouterTap
    from rltrain.models.tiny import build_tiny_model
    from rltrain.rollout import GeneratorPool

    path = str(build_tiny_model(tmp_path / "moe", family="qwen3_moe"))
    config = Config.model_validate(
        {"model": {"name_or_path": path},
         "rollout": {"max_new_tokens": 360, "inflight_updates": True, "routing_replay": True}}
    )  # fmt: skip
    old = AutoModelForCausalLM.from_pretrained(path).eval()
    new = nudged(path, 0.05)
    prompts = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [40, 41, 42], [9, 9, 9, 9]] * 2
    generators = GeneratorPool(config, path)
    try:
        generators.collect(generators.submit(prompts[:1], seeds=[0]))  # the engine is up
        refs = generators.submit(prompts, seeds=list(range(1, 9)))
        time.sleep(0.2)  # the rollout is generating: the weights arrive between two of its decode steps
        start = time.perf_counter()
        generators.load_weights(ray.put(new.state_dict()), 1)
        staged_s = time.perf_counter() - start
        completions = generators.collect(refs)
        wait_s = time.perf_counter() - start
    finally:
        generators.shutdown()
    print(f"load_weights returned after {staged_s:.2f} s, the rollout ended {wait_s:.2f} s after it was sent")
    spanning = [c for c in completions if set(c.versions) == {0, 1}]
    assert spanning, [c.versions for c in completions]  # the weights arrived mid-request
    gaps = {0: [], 1: []}  # |engine - old model| per token, by version
    tap = RouterTap(old)
    for prompt, c in zip(prompts, completions):
        assert c.versions == sorted(c.versions)  # versions only move forward within a request
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad(), tap.capture() as (_, chosen):
            old_logprobs = sequence_logprobs(old, ids, torch.ones_like(ids), temperature=1.0)[0][0][
                len(prompt) :
            ]
        for version, gap in zip(c.versions, (torch.tensor(c.logprobs) - old_logprobs).abs().tolist()):
            gaps[version].append(gap)
        # routes: every position that ran (all but the last token), 2 layers x top-2; those whose
        # forward ran on the old weights (the prompt and the tokens sampled before the update,
        # but the last of them) are the old model's own top-2, position by position
        assert c.routes.shape == (len(prompt) + len(c.token_ids) - 1, 2, 2)
        assert (c.routes != ROUTE_UNKNOWN).all()  # every position that ran recorded
        before = len(prompt) + c.versions.count(0) - 1
        own = torch.stack(chosen, 1)[:before].sort(-1).values
        assert torch.equal(torch.tensor(c.routes[:before]).long().sort(-1).values, own)
    # version 0 tokens carry the first weights' log-probs exactly; version 1 tokens were sampled by
    # the new weights (over a cache partly computed by the old ones) and their log-probs say so
    assert max(gaps[0]) < 1e-4, max(gaps[0])
    assert sum(gaps[1]) / len(gaps[1]) > 1e-2, sum(gaps[1]) / len(gaps[1])


@pytest.mark.slow
def test_inflight_adapters_reach_a_vllm_engine_between_chunks_and_every_token_keeps_its_version(
    ray_local, tmp_path
):
    """vLLM binds a LoRA adapter to a request when the request starts: with adapters an engine
    takes in-flight updates between chunks, each chunk a request of the newest adapter. The model
    is a Llama that ties its output head to its embeddings, as SmolLM2 does (vLLM gave that head a
    LoRA layer, whose prompt log-probs, which the sync check reads, failed on CPU)."""
    import ray
    from transformers import AutoModelForCausalLM

    from rltrain.config import Config
    from rltrain.forward import sequence_logprobs
    from rltrain.models import adapters
    from rltrain.models.tiny import build_tiny_model
    from rltrain.rollout import GeneratorPool

    tiny_model_path = str(build_tiny_model(tmp_path / "llama", tie_word_embeddings=True, family="llama"))

    config = Config.model_validate(
        {
            "model": {"lora": {"rank": 8}},
            "rollout": {"max_new_tokens": 360, "inflight_updates": True, "inflight_chunk_tokens": 4},
        }
    )
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    policy = adapters.wrap(AutoModelForCausalLM.from_pretrained(tiny_model_path), config.model.lora).eval()
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # B = 0 leaves the base's function: give the adapter one
                p.normal_(0, 0.5)
    adapter = {adapters.file_name(k): v for k, v in policy.state_dict().items() if adapters.is_adapter(k)}
    prompts = [[5, 17, 99, 3, 250, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [40, 41, 42], [9, 9, 9, 9]] * 2
    generators = GeneratorPool(config, tiny_model_path, lora=True)
    try:
        generators.collect(generators.submit(prompts[:1], seeds=[0]))  # the engine is up
        refs = generators.submit(prompts, seeds=list(range(1, 9)))
        time.sleep(0.2)  # the rollout is generating: the adapter arrives between two of its chunks
        generators.load_weights(ray.put(adapter), 1)
        completions = generators.collect(refs)
        sequences = [p + c.token_ids for p, c in zip(prompts, completions)]
        engine_scores = generators.prompt_logprobs(sequences)  # with the newest adapter
    finally:
        generators.shutdown()
    assert [c for c in completions if set(c.versions) == {0, 1}], [c.versions for c in completions]
    gaps = {0: [], 1: []}  # |engine - the model of the token's version| per token
    for prompt, c in zip(prompts, completions):
        assert c.versions == sorted(c.versions)  # versions only move forward within a request
        ids = torch.tensor([prompt + c.token_ids])
        by_version = {
            v: sequence_logprobs(m, ids, torch.ones_like(ids), temperature=1.0)[0][0][len(prompt) :]
            for v, m in [(0, base), (1, policy)]
        }
        for t, version in enumerate(c.versions):
            gaps[version].append(abs(c.logprobs[t] - by_version[version][t].item()))
    # each chunk is a fresh request of one adapter (its prefix cached per adapter): every token's
    # log-prob is that of the weights its version names, the base's before the update, the adapted
    # model's after it
    assert max(gaps[0]) < 1e-4 and max(gaps[1]) < 1e-4, (max(gaps[0]), max(gaps[1]))
    for seq, scores in zip(sequences, engine_scores):
        ids = torch.tensor([seq])
        ours = sequence_logprobs(policy, ids, torch.ones_like(ids), temperature=1.0)[0][0]
        assert (torch.tensor(scores[1:]) - ours[1:]).abs().max() < 1e-4  # (position 0 has no prefix)


def test_where_versions_mix_the_mismatch_is_measured_on_the_tokens_the_current_weights_sampled():
    from rltrain.batch import collate
    from rltrain.losses import policy_loss

    # two completions after 1-token prompts; the learners hold version 3
    mixed = [completion([2, 3, 3]), completion([3, 2], tool_mask=[1, 0])]
    batch = collate([[9], [9]], mixed, torch.zeros(2), pad_id=0, version=3)
    # columns: prompt, then 3 completion tokens; the tool token (version 2 or not) is never sampled
    assert batch.fresh_mask.tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert collate([[9]], [completion([3, 3])], torch.zeros(1), 0, version=3).fresh_mask is None  # all fresh
    # none fresh (a resumed run's rollouts generated ahead): nothing to measure the gap on
    assert collate([[9]], [completion([2, 2])], torch.zeros(1), 0, version=3).fresh_mask.tolist() == [
        [0, 0, 0]
    ]

    # engine log-probs 0 everywhere; the learner's: -1 on the stale token (the policy moved since),
    # -0.1 on the fresh ones
    learner = torch.tensor([[0.0, -1.0, -0.1, -0.1], [0.0, -0.1, 0.0, 0.0]])
    engine = torch.zeros(2, 4)
    args = (learner, learner, torch.zeros(2), batch.response_mask, None)
    kw = {"tool_mask_BT": batch.tool_mask, "generator_logprobs_BT": engine}
    _, everywhere = policy_loss(*args, **kw)
    _, fresh = policy_loss(*args, **kw, fresh_BT=batch.fresh_mask)
    k3 = lambda d: math.exp(d) - d - 1  # noqa: E731  (d = learner - engine)
    # every sampled token: -1 once and -0.1 three times; fresh only: -0.1 three times
    assert everywhere["mismatch_tokens"] == 4 and fresh["mismatch_tokens"] == 3
    assert everywhere["mismatch_kl"].item() == pytest.approx(k3(-1.0) + 3 * k3(-0.1))
    assert fresh["mismatch_kl"].item() == pytest.approx(3 * k3(-0.1))
    assert fresh["mismatch_max"].item() == pytest.approx(0.1) and everywhere["mismatch_max"].item() == 1.0
