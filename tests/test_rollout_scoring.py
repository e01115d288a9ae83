"""The transformers generation backend, and DAPO's dynamic sampling in the training loop."""

import torch

from rltrain.batch import Completion
from rltrain.config import Config
from rltrain.data import Prompt
from rltrain.forward import sequence_logprobs
from rltrain.rewards.functions import RewardScorer
from rltrain.rollout import GeneratorActor
from rltrain.run.orchestrator import collect_groups


def test_hf_backend_rollout_with_tools_and_generator_logprobs(tiny_model_path):
    config = Config.model_validate(
        {
            "rollout": {
                "backend": "hf",
                "max_new_tokens": 12,
                "temperature": 0.7,
                "tools": {"enabled": ["calculator"]},
            }
        }
    )
    actor = GeneratorActor(config, tiny_model_path, engine_index=0)
    prompts = [[256, 10, 20, 30], [256, 40]]
    first = actor.rollout(prompts, seeds=[1, 2])
    again = actor.rollout(prompts, seeds=[1, 2])
    assert [c.token_ids for c in first] == [c.token_ids for c in again]  # per-request seeds: reproducible
    for prompt, c in zip(prompts, first):
        assert 0 < len(c.token_ids) <= 12 and c.tool_mask == [1] * len(c.token_ids)
        assert c.finish_reason in ("stop", "length")
        ids = torch.tensor([prompt + c.token_ids])
        expected, _ = sequence_logprobs(actor.backend.model, ids, torch.ones_like(ids), temperature=0.7)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected[0, len(prompt) :], atol=1e-5, rtol=0)


class ScriptedPool:
    """Stands in for the generator actors: round r answers with the texts given for round r."""

    def __init__(self, rounds: list[list[str]]):
        self.rounds, self.submitted = rounds, []

    def submit(self, prompt_ids, seeds):
        self.submitted.append(len(prompt_ids))
        return self.rounds[len(self.submitted) - 1]

    def collect(self, texts):
        return [Completion(token_ids=[1], logprobs=[0.0], tool_mask=[1], text=t) for t in texts]


class Sampler:
    def __init__(self):
        self.next = 100

    def take(self, n):
        self.next += n
        return [Prompt(self.next - n + i, [1, 2], "7") for i in range(n)]


def test_dynamic_sampling_drops_zero_variance_groups_and_refills():
    config = Config.model_validate(
        {
            "algorithm": {
                "group_size": 2,
                "prompts_per_step": 3,
                "dynamic_sampling": True,
                "max_sampling_rounds": 3,
            }
        }
    )
    # round 1 (the step's own prompts): groups (7, 7) same, (7, x) informative, (x, x) same
    # round 2: (x, 7) informative, (7, 7) same, (7, x) informative -> 3 informative groups in all
    pool = ScriptedPool([["7", "7", "7", "x", "x", "x"], ["x", "7", "7", "7", "7", "x"]])
    sampler = Sampler()
    first = sampler.take(3)
    refs = pool.submit(
        [p.token_ids for p in first for _ in range(2)], seeds=list(range(6))
    )  # as the loop does
    with RewardScorer({"exact_match": 1.0}, timeout_s=5) as scorer:
        scored = collect_groups(pool, refs, first, sampler, config, scorer, step=1)
    assert pool.submitted == [6, 6]  # one refill round of 3 prompts x 2
    assert len(scored.prompts) == 3 and len(scored.completions) == 6
    assert [c.text for c in scored.completions] == ["7", "x", "x", "7", "7", "x"]
    assert scored.rewards.tolist() == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]
    assert scored.metrics["rollout/sampling_rounds"] == 2.0
    assert scored.prompts[0].index == first[1].index  # the informative group of round 1 is kept, in order


def test_overlong_penalty_is_in_the_reward_and_logged_apart_from_the_functions():
    from rltrain.run.scoring import score

    config = Config.model_validate({
        "algorithm": {"group_size": 2, "overlong": "soft_penalty", "overlong_buffer": 4, "overlong_penalty": 0.5},
        "rollout": {"max_new_tokens": 20},
    })  # fmt: skip
    prompts = [Prompt(0, [1, 2], "7")]
    # 16 tokens: before the ramp (20 - 4), no penalty; 18 tokens: halfway up the ramp, -0.25
    completions = [Completion(token_ids=[3] * n, tool_mask=[1] * n, text="7") for n in (16, 18)]
    with RewardScorer({"exact_match": 1.0}, timeout_s=5) as scorer:
        scored = score(prompts, completions, config, scorer)
    assert scored.rewards.tolist() == [1.0, 0.75]
    assert scored.metrics["reward/exact_match"] == 1.0  # the function's own score, unshaped
    assert scored.metrics["reward/overlong"] == -0.125  # (0 - 0.25) / 2
    assert scored.metrics["reward/mean"] == 0.875


def completion(text: str, finish: str = "stop", **fields) -> Completion:
    ids = list(text.encode())
    return Completion(ids, [-0.5] * len(ids), [1] * len(ids), text=text, finish_reason=finish, **fields)


def test_samples_that_failed_outside_the_policy_are_kept_out_of_the_loss_and_their_groups_stats():
    from rltrain.config import load_config
    from rltrain.run.scoring import build_batch, drop_failed, score

    config = load_config(None, ["algorithm.group_size=4", "algorithm.overlong=none",
                                "reward.functions={reward_fns:raises_unless_right: 1.0, digits: 1.0}"])  # fmt: skip
    prompts = [Prompt(0, [256, 1], "12", {}), Prompt(1, [256, 2], "7", {})]
    # group 0: two right answers, one the reward function cannot score ("x1"), one malformed tool
    # call (the policy's own failure: scored as it is); group 1: three cannot be scored -> 1 left
    group0 = [completion("12"), completion("12"), completion("x1"), completion("12", errors={"bad_json": 1})]
    group1 = [completion("7"), completion("a"), completion("b"), completion("c")]
    with RewardScorer(config.reward.functions, timeout_s=5) as scorer:
        scored = score(prompts, group0 + group1, config, scorer)
    fn = "reward_fns:raises_unless_right"
    assert scored.failed == [None, None, fn, None, None, fn, fn, fn]
    assert scored.metrics["failures/outside_policy"] == 4 and scored.metrics["failures/policy"] == 1
    # every reward figure is over the four samples that count (0, 1, 3 and 4: each 2, see below);
    # with the failed ones in (their reward: digits alone, 0.5 for "x1", 0 for "a", "b", "c") it
    # would be (2 + 2 + 0.5 + 2 + 2 + 0 + 0 + 0) / 8 = 1.0625 and no group would be flat
    assert (scored.metrics["reward/mean"], scored.metrics["reward/std"]) == (2.0, 0.0)
    assert scored.metrics["reward/digits"] == 1.0 and scored.metrics[f"reward/{fn}"] == 1.0
    assert scored.metrics["rollout/zero_variance_groups"] == 1.0  # both groups' valid samples agree
    gae = drop_failed(scored, 4, fewest=1)  # a critic needs no group: group 1's valid sample stays
    assert [p.index for p in gae.prompts] == [0, 1] and gae.metrics["rollout/dropped_samples"] == 4
    kept = drop_failed(scored, 4)
    assert [p.index for p in kept.prompts] == [0]  # group 1 had one sample left: it goes whole
    assert kept.metrics["rollout/dropped_samples"] == 5  # x1, and all of group 1
    batch = build_batch(kept, config, pad_id=0)
    # rewards: "12" -> 1 + digits 1 = 2, "x1" -> 0 (failed) + 0.5 = 0.5, malformed "12" -> 2; the
    # valid ones all 2: no variance, advantage 0 -- with the failed 0.5 counted they would differ
    assert batch.advantages.abs().sum() == 0
    assert batch.response_mask[2].sum() == 0 and batch.response_mask[[0, 1, 3]].sum(-1).tolist() == [2, 2, 2]
    zero = load_config(None, ["algorithm.group_size=4", "algorithm.overlong=none", "reward.on_failure=zero",
                              f"reward.functions={{{fn}: 1.0, digits: 1.0}}"])  # fmt: skip
    old = build_batch(scored.keep(torch.tensor([True, False]), 4), zero, pad_id=0)
    assert old.response_mask[2].sum() == 2 and old.advantages[2] < 0  # the old way: trained on as 0


def test_an_episode_that_failed_outside_the_policy_or_sampled_nothing_is_a_failed_sample():
    from rltrain.run.scoring import episode_failure

    assert episode_failure(completion("ok")) is None
    assert episode_failure(completion("", finish="error", failures={"agent": "Traceback ..."})) == "agent"
    assert episode_failure(Completion(finish_reason="stop", by_agent=True)) == "no token sampled"
    assert episode_failure(completion("cut", finish="length")) is None  # overlong: the policy's own


def test_a_version_bump_sends_no_weights_and_keeps_weights_not_yet_taken(tiny_model_path, monkeypatch):
    config = Config.model_validate({"rollout": {"backend": "hf", "inflight_updates": True}})
    actor = GeneratorActor(config, tiny_model_path, engine_index=0)
    loads = []
    monkeypatch.setattr(actor.backend, "load_weights", lambda named: loads.append(dict(named)))
    actor.load_weights({}, 3)  # a step without an update: the same weights, as policy version 3
    assert actor.version == 3 and loads == []
    # new weights not yet taken (a rollout in progress holds the engine), then a version bump:
    # the bump keeps them, and they are taken as the newer version
    actor._engine.acquire()
    weights = {"lm_head.weight": actor.backend.model.lm_head.weight.detach().clone()}
    actor.load_weights(weights, 4)
    actor.load_weights({}, 5)
    actor._engine.release()
    assert actor._between_steps() == 5 and list(loads[0]) == ["lm_head.weight"]
