"""Model-based training signals: on-policy distillation from a teacher and a reward model, from
the pure advantage math to real Ray actors and DeepSpeed learners."""

import threading

import pytest
import torch

from rltrain.batch import Completion, TrainBatch
from rltrain.config import Config
from rltrain.data import Prompt
from rltrain.loss.advantages import distill_advantages
from rltrain.rewards.functions import RewardScorer
from rltrain.run.scoring import with_distillation


def test_distillation_advantages_by_hand():
    teacher = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    student = torch.tensor([[0.0, -1.5, -1.0, -0.3]])
    mask = torch.tensor([[0, 1, 1, 0]])  # position 0: prompt; position 3: a tool's token
    # coef 1: teacher - student on sampled tokens: -1.0 - -1.5 = 0.5; -2.0 - -1.0 = -1.0
    torch.testing.assert_close(
        distill_advantages(teacher, student, mask), torch.tensor([[0.0, 0.5, -1.0, 0.0]])
    )
    # coef 0.5 with a task advantage of 2: 0.5 * 0.5 + 0.5 * 2 = 1.25; 0.5 * -1.0 + 0.5 * 2 = 0.5
    mixed = distill_advantages(teacher, student, mask, 0.5, torch.tensor([2.0]))
    torch.testing.assert_close(mixed, torch.tensor([[0.0, 1.25, 0.5, 0.0]]))
    with pytest.raises(ValueError, match="mixes in task advantages"):
        distill_advantages(teacher, student, mask, 0.5)


def test_with_distillation_uses_the_engines_log_probs_and_reports_the_reverse_kl():
    ids = torch.zeros(1, 4, dtype=torch.long)
    batch = TrainBatch(
        ids,
        torch.ones_like(ids),
        torch.tensor([[0, 1, 1, 1]]),
        torch.tensor([[1, 1, 1, 0]]),  # the last token a tool's
        torch.tensor([3.0]),  # GRPO's advantage, ignored at distill_coef 1
        generator_logprobs=torch.tensor([[0.0, -1.5, -1.0, 0.0]]),
    )
    alg = Config.model_validate({"algorithm": {"advantage": "distill", "teacher": "t"}}).algorithm
    out, metrics = with_distillation(batch, torch.tensor([[-9.0, -1.0, -2.0, -9.0]]), alg)
    torch.testing.assert_close(out.advantages, torch.tensor([[0.0, 0.5, -1.0, 0.0]]))
    # student - teacher on the two sampled tokens: (-1.5 + 1.0 + -1.0 + 2.0) / 2 = 0.25
    assert metrics["distill/reverse_kl"] == pytest.approx(0.25)


def test_policy_gradient_on_distillation_advantages_descends_the_reverse_kl():
    # one categorical position: the student samples, the advantage of each sample is its
    # teacher - student log-prob; plain policy-gradient steps bring KL(student || teacher) down
    g = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(8, generator=g) * 2, -1)
    logits = torch.zeros(8, requires_grad=True)
    optimizer = torch.optim.SGD([logits], lr=0.5)

    @torch.no_grad()
    def reverse_kl() -> float:
        student = torch.log_softmax(logits, -1)
        return float((student.exp() * (student - teacher)).sum())

    start = reverse_kl()
    for _ in range(50):
        student = torch.log_softmax(logits, -1)
        samples = torch.multinomial(student.exp().detach(), 256, replacement=True, generator=g)
        chosen = student[samples]
        advantages = distill_advantages(teacher[samples][None], chosen.detach()[None], torch.ones(1, 256))[0]
        optimizer.zero_grad()
        (-(advantages * chosen).mean()).backward()
        optimizer.step()
    assert reverse_kl() < 0.2 * start, (start, reverse_kl())


def test_reward_model_scores_join_the_weighted_sum_and_failures_are_counted():
    with RewardScorer({"model": 1.0, "exact_match": 0.5}, timeout_s=5.0, workers=1) as scorer:
        scores = scorer(["12", "7"], ["12", "12"], {"model": [0.25, None]})
    # 1.0 * 0.25 + 0.5 * 1 (exact) = 0.75; None (not scored) is 0 and a failure: 0 + 0.5 * 0 = 0
    assert scores.rewards == [0.75, 0.0]
    assert scores.failures == 1
    assert scores.per_sample["model"] == [0.25, 0.0]


def test_verdicts_are_parsed_by_pattern_and_values():
    from rltrain.rewards.judge import parse_verdict

    pattern, values = r"Verdict:\s*(\w+)", {"correct": 1.0, "incorrect": 0.0}
    assert parse_verdict("Verdict: CORRECT", pattern, values) == 1.0  # case-insensitive
    assert (
        parse_verdict("Verdict: correct... no wait. Verdict: incorrect", pattern, values) == 0.0
    )  # the last
    assert parse_verdict("I think it is right", pattern, values) is None  # no verdict
    assert parse_verdict("Verdict: maybe", pattern, values) is None  # not listed
    assert parse_verdict("Score: 7.5/10", r"Score:\s*([\d.]+)", {}) == 7.5  # a number
    assert parse_verdict("Score: 1e999", r"Score:\s*(\S+)", {}) is None  # not finite


class ScriptedEngines:
    """Replies by the judge prompt's order; None: an engine that did not answer in time."""

    def __init__(self, replies):
        self.replies, self.asked = replies, []

    def complete(self, prompts, max_tokens, timeout_s):
        self.asked.append(prompts)
        return self.replies[: len(prompts)]


def test_the_judge_scores_verdicts_and_counts_what_it_could_not_score(tiny_model_path):
    from transformers import AutoTokenizer

    from rltrain.config import JudgeConfig
    from rltrain.rewards.judge import Judge

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    prompts = [Prompt(0, [1, 2], "12", {"prompt": "What is 5 + 7?"})] * 3 + [
        Prompt(1, [3], "9", {"prompt": "x" * 500})
    ]
    completions = [Completion(token_ids=[5], text=t) for t in ("12", "13", "twelve", "9")]
    engines = ScriptedEngines(["Verdict: correct", "Verdict: incorrect", None])
    judge = Judge(JudgeConfig(), tokenizer, engines, max_prompt_tokens=400)
    scores, metrics = judge(prompts, completions)
    # the 4th prompt (a 500-character question) is over 400 tokens: not asked; the 3rd timed out
    assert scores == [1.0, 0.0, None, None]
    assert metrics == {
        "reward/judge_unparsed": 0.0,
        "reward/judge_timeouts": 1.0,
        "reward/judge_too_long": 1.0,
    }
    asked = tokenizer.decode(engines.asked[0][1])
    assert "What is 5 + 7?" in asked and "Reference answer: 12" in asked and "Student answer: 13" in asked
    engines.replies = ["Verdict: ?", "no idea", "Verdict: correct"]
    scores, metrics = judge(prompts[:3], completions[:3])
    assert scores == [None, None, 1.0] and metrics["reward/judge_unparsed"] == 2.0


class GeneratedOnRelease:
    """Generator stand-in: the n-th submission's completions come out of ``collect`` once the test
    releases it (generation in progress until then); completion i of a submission reads str(i)."""

    def __init__(self, submissions: int):
        self.released = [threading.Event() for _ in range(submissions)]
        self.submitted = 0

    def submit(self, requests, seeds):
        self.submitted += 1
        return [(self.submitted - 1, len(requests))]

    def collect(self, refs):
        ((index, count),) = refs
        assert self.released[index].wait(10), f"submission {index} was never released"
        return [Completion(token_ids=[1] * (index + 1), text=str(i)) for i in range(count)]


class RecordingScorer:
    """A model scorer: a completion's score is its length in tokens; records the thread of each call."""

    def __init__(self, own_actors: bool):
        self.own_actors, self.calls, self.called = own_actors, [], threading.Event()

    def __call__(self, prompts, completions):
        self.calls.append((threading.current_thread().name, len(completions[0].token_ids)))
        self.called.set()
        return [float(len(c.token_ids)) for c in completions], {}


def test_a_scorer_on_its_own_actors_scores_the_step_ahead_while_the_policy_trains():
    from rltrain.prompt_sampler import PromptSampler
    from rltrain.run.orchestrator import Orchestrator

    config = Config.model_validate({
        "algorithm": {"group_size": 2, "prompts_per_step": 1},
        "rollout": {"max_staleness": 1},
        "reward": {"model": "rm", "judge": {}, "functions": {"model": 1.0, "judge": 1.0}},
        "run": {"steps": 2},
    })  # fmt: skip
    beside, inline = RecordingScorer(own_actors=True), RecordingScorer(own_actors=False)
    pool = GeneratedOnRelease(submissions=2)
    sampler = PromptSampler([Prompt(i, [1, 2], "7") for i in range(4)], seed=0)
    with RewardScorer(config.reward.functions, timeout_s=5) as scorer:
        orchestrator = Orchestrator(config, sampler, pool, scorer, {"model": beside, "judge": inline})
        try:
            pool.released[0].set()
            step_1 = orchestrator.next_batch(1)  # submits steps 1 and 2, scores step 1
            # step 1's completions are 1 token long, step 2's 2 tokens: 1.0 (model) + 1.0 (judge) = 2.0
            assert step_1.rewards.tolist() == [2.0, 2.0]
            assert [length for _, length in beside.calls] == [1]
            beside.called.clear()
            # the policy trains on step 1 now; step 2's generation ends, and its reward model
            # scores come in with nobody asking, in the scoring thread
            pool.released[1].set()
            assert beside.called.wait(10)
            assert [length for _, length in beside.calls] == [1, 2]
            assert [length for _, length in inline.calls] == [1]  # the judge on the policy's engines waits
            step_2 = orchestrator.next_batch(2)
            # 2.0 (model, scored ahead) + 2.0 (judge, scored now) = 4.0; nothing scored twice
            assert step_2.rewards.tolist() == [4.0, 4.0]
            assert len(beside.calls) == 2 and len(inline.calls) == 2
            assert "time/model_scoring_s" in step_2.metrics
            assert {thread for thread, _ in beside.calls} == {"rltrain-scoring_0"}
            assert {thread for thread, _ in inline.calls} == {threading.current_thread().name}
        finally:
            orchestrator.close()


# ---------------------------------------------------------------------------- real actors


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory) -> str:
    """A teacher: the tiny model's architecture and tokenizer, other weights."""
    from rltrain.models.tiny import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("teacher") / "model", seed=1))


@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory, tiny_model_path) -> str:
    """A one-label sequence classifier on the tiny model, its score head drawn at random."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(2)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    torch.nn.init.normal_(model.score.weight, std=1.0)
    out = tmp_path_factory.mktemp("rm") / "model"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(out)
    return str(out)


def scorer_config(section: str, path: str, **layout) -> Config:
    """A layout of a teacher's (``algorithm``) or reward model's (``reward``) actors, for
    :func:`rltrain.diagnostics.synthetic_rollouts` (t=14) at temperature 0.7."""
    from rltrain.diagnostics import layout_config

    raw = layout_config(1, 2, 0).model_dump()
    raw["rollout"]["temperature"] = 0.7
    if section == "algorithm":
        raw["algorithm"] |= {"advantage": "distill", "teacher": path, "teacher_learners": layout}
    else:
        raw["reward"] |= {"model": path, "functions": {"model": 1.0}, "model_learners": layout}
    return Config.model_validate(raw)


def scored_by(config: Config, learner_cls, batch: TrainBatch) -> torch.Tensor:
    from rltrain.diagnostics import learners

    with learners(config, "unused: the scorers load their own model", 0, learner_cls) as group:
        return group.per_token(batch)


SCORER_LAYOUTS = {
    "1 actor, padded micro-batches of 3": {"num_learners": 1, "packing": False, "micro_batch_size": 3},
    "2 actors, packed under 20 tokens": {"num_learners": 2, "max_tokens_per_micro_batch": 20},
    "2 actors, ZeRO-3 sharded, packed": {"num_learners": 2, "zero_stage": 3},
}


@pytest.mark.slow
def test_the_teachers_actors_give_its_log_probs_on_every_layout(ray_local, kept_learners, teacher_path):
    from transformers import AutoModelForCausalLM

    from rltrain.diagnostics import synthetic_rollouts
    from rltrain.forward import sequence_logprobs
    from rltrain.learner.frozen import TeacherLearner

    batch = synthetic_rollouts()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_path)
    with torch.no_grad():
        expected, _ = sequence_logprobs(teacher, batch.input_ids, batch.attention_mask, temperature=0.7)
    keep = batch.response_mask.bool()
    for name, layout in SCORER_LAYOUTS.items():
        got = scored_by(scorer_config("algorithm", teacher_path, **layout), TeacherLearner, batch)
        torch.testing.assert_close(got[keep], expected[keep], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_teacher_whose_actor_dies_gives_no_log_probs_and_starts_afresh(ray_local, teacher_path):
    from functools import partial

    import ray

    from rltrain.diagnostics import synthetic_rollouts
    from rltrain.learner.frozen import TeacherLearner
    from rltrain.learner.group import LearnerGroup
    from rltrain.run.frozen_models import Teacher

    batch, config = synthetic_rollouts(), scorer_config("algorithm", teacher_path, num_learners=1)
    teacher = Teacher(partial(LearnerGroup, config, "unused", 0, TeacherLearner))
    try:
        first = teacher.per_token(batch)
        ray.kill(teacher.group.actors[0])
        failed = teacher.per_token(batch)  # the step is not trained; the actors start afresh
        again = teacher.per_token(batch)
    finally:
        teacher.shutdown()
    assert failed is None
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.slow
def test_the_reward_models_actors_score_as_sequence_classification(
    ray_local, kept_learners, reward_model_path
):
    from transformers import AutoModelForSequenceClassification

    from rltrain.diagnostics import synthetic_rollouts
    from rltrain.learner.frozen import RewardModelLearner, last_token_scores

    batch = synthetic_rollouts()
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_path)
    with torch.no_grad():  # each sequence alone, unpadded: what the classifier pools is unambiguous
        expected = torch.stack([
            model(input_ids=ids[mask.bool()][None]).logits[0, 0]
            for ids, mask in zip(batch.input_ids, batch.attention_mask)
        ])  # fmt: skip
    assert expected.std() > 0.1  # the scores differ between sequences
    for name in ("1 actor, padded micro-batches of 3", "2 actors, packed under 20 tokens"):
        config = scorer_config("reward", reward_model_path, **SCORER_LAYOUTS[name])
        got = last_token_scores(scored_by(config, RewardModelLearner, batch), batch.attention_mask)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_reward_model_whose_actor_dies_scores_zero_is_counted_and_starts_afresh(
    ray_local, reward_model_path
):
    from functools import partial

    import ray
    from transformers import AutoModelForSequenceClassification

    from rltrain.learner.frozen import RewardModelLearner
    from rltrain.learner.group import LearnerGroup
    from rltrain.run.frozen_models import RewardModel

    config = scorer_config("reward", reward_model_path, num_learners=1)
    prompts = [Prompt(0, [5, 6, 7], "1"), Prompt(1, [9], "2")]
    completions = [Completion([8, 9], [0.0, 0.0], [1, 1]), Completion([10, 11, 12], [0.0] * 3, [1, 0, 1])]
    reward_model = RewardModel(partial(LearnerGroup, config, "unused", 0, RewardModelLearner))
    try:
        scores, metrics = reward_model(prompts, completions)
        ray.kill(reward_model.group.actors[0])
        failed, failed_metrics = reward_model(prompts, completions)
        again, _ = reward_model(prompts, completions)
    finally:
        reward_model.shutdown()
    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_path)
    with torch.no_grad():  # each sequence is its prompt's ids and the completion's, tool tokens included
        expected = [
            hf(input_ids=torch.tensor([ids])).logits[0, 0].item()
            for ids in ([5, 6, 7, 8, 9], [9, 10, 11, 12])
        ]
    assert scores == pytest.approx(expected, abs=1e-5) and metrics == {"reward/model_failures": 0.0}
    assert failed == [None, None] and failed_metrics == {"reward/model_failures": 2.0}
    assert again == pytest.approx(expected, abs=1e-5)  # the restarted actors score again


@pytest.mark.slow
def test_the_distillation_update_is_layout_invariant_in_token_mode(
    ray_local, kept_learners, tiny_model_path, teacher_path
):
    from transformers import AutoModelForCausalLM

    from rltrain.diagnostics import (
        layout_config,
        relative_difference,
        synthetic_rollouts,
        updates_after_one_step,
    )
    from rltrain.forward import sequence_logprobs

    batch = synthetic_rollouts()
    with torch.no_grad():
        student, _ = sequence_logprobs(
            AutoModelForCausalLM.from_pretrained(tiny_model_path), batch.input_ids, batch.attention_mask
        )
        teacher, _ = sequence_logprobs(
            AutoModelForCausalLM.from_pretrained(teacher_path), batch.input_ids, batch.attention_mask
        )
    keep = batch.response_mask.bool() & batch.tool_mask.bool()
    batch = batch.replace(generator_logprobs=torch.where(keep, student, 0.0))
    alg = scorer_config("algorithm", teacher_path).algorithm.model_copy(update={"distill_coef": 0.7})
    batch, _ = with_distillation(batch, teacher, alg)
    assert batch.advantages.shape == batch.input_ids.shape and batch.advantages[keep].std() > 0.1

    layouts = {
        "2 learners x micro-batches of 3, ZeRO-2": layout_config(2, 3, 2),
        "2 learners packed under 16 tokens, ZeRO-3": layout_config(2, 1, 3, max_tokens_per_micro_batch=16),
    }
    reference, *updates, naive_split, naive_one = updates_after_one_step(
        [layout_config(1, 8, 0), *layouts.values(), layout_config(2, 3, 2, None), layout_config(1, 8, 0, None)],
        tiny_model_path, batch,
    )  # fmt: skip
    diffs = {name: relative_difference(u, reference) for name, u in zip(layouts, updates)}
    naive = relative_difference(naive_split, naive_one)
    print(f"distillation: token mode {diffs}; per-micro-batch mode {naive:.3e}")
    assert max(diffs.values()) < 1e-5, diffs
    assert naive > 1e-2, naive


@pytest.mark.slow
def test_a_run_distills_from_a_teacher_with_a_reward_model_and_a_judge_in_the_reward(
    tmp_path, teacher_path, reward_model_path, ray_cluster
):
    # one short CLI run with all three: the teacher's and the reward model's own actors, GRPO mixed
    # in, and the policy's engine as the judge (the tiny model gives no verdict: each is counted);
    # one step generated ahead
    import json
    import math
    import os
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", f"run.output_dir={out}",
         "algorithm.prompts_per_step=4", "algorithm.group_size=4", "rollout.max_new_tokens=16",
         "algorithm.overlong_buffer=8", "sft_warmup.steps=0", "run.eval_every=0", "run.ray_num_cpus=2",
         "run.steps=2", "algorithm.advantage=distill", f"algorithm.teacher={teacher_path}",
         "algorithm.distill_coef=0.5", f"reward.model={reward_model_path}",
         "reward.functions={math: 1.0, model: 0.5, judge: 1.0}", "reward.judge={max_new_tokens: 8}",
         "algorithm.teacher_learners.cpus_per_learner=0.25",
         "reward.model_learners.cpus_per_learner=0.25", "rollout.max_staleness=1",
         # (an unparsed verdict is a failed reward: trained on as 0 here, or every group would go)
         "reward.on_failure=zero"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600,
        env={**os.environ, **ray_cluster},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["distill/reverse_kl"]) and r["reward/model"] != 0.0
        # step 2, generated ahead (rollout.max_staleness=1), was scored by the reward model in the
        # scoring thread; the judge, on the policy's engine, in the loop
        assert r["time/model_scoring_s"] > 0
        # the weighted sum: 1.0 * math + 0.5 * model + 1.0 * judge + the overlong shaping
        expected = r["reward/math"] + 0.5 * r["reward/model"] + r["reward/judge"] + r["reward/overlong"]
        assert r["reward/mean"] == pytest.approx(expected, abs=1e-5)
        # 16 completions a step, each put to the judge: every one answered in time
        assert r["reward/judge_timeouts"] == 0.0 and r["reward/judge_too_long"] == 0.0
        assert r["reward/failures"] >= r["reward/judge_unparsed"] > 0
    actors = {place["actor"] for place in json.loads((out / "placement.json").read_text())}
    assert {"teacher 0", "reward model 0"} <= actors
    AutoModelForCausalLM.from_pretrained(out / "final_model")


class ByPrompt:
    """Generator stand-in: every completion of a prompt reads the prompt's answer for prompts 0-1
    (exact match: solved by the whole group) and "wrong" for the others (never solved), each with one
    sampled token."""

    def __init__(self):
        self.requests = []

    def submit(self, requests, seeds):
        self.requests.append(list(requests))
        return [list(requests)]

    def collect(self, refs):
        (requests,) = refs
        return [Completion(token_ids=[1], tool_mask=[1], text="7" if r == [1, 0] or r == [1, 1] else "wrong")
                for r in requests]  # fmt: skip


def test_difficulty_sampling_learns_each_groups_mean_before_dynamic_sampling_drops_it():
    from rltrain.prompt_sampler import PromptSampler
    from rltrain.run.orchestrator import Orchestrator

    # every group has zero variance (all right or all wrong): dynamic sampling drops them all and
    # refills, 3 rounds; the sampler learns each drawn group's mean all the same
    config = Config.model_validate({
        "algorithm": {"group_size": 2, "prompts_per_step": 2, "dynamic_sampling": True, "max_sampling_rounds": 3},
        "reward": {"functions": {"exact_match": 1.0}}, "run": {"steps": 1},
        "data": {"difficulty_sampling": {}},
    })  # fmt: skip
    prompts = [Prompt(i, [1, i], "7") for i in range(8)]  # (a prompt's ids name it: [1, i])
    sampler = PromptSampler(prompts, seed=0, difficulty=config.data.difficulty_sampling)
    with RewardScorer(config.reward.functions, timeout_s=5) as scorer:
        batch = Orchestrator(config, sampler, ByPrompt(), scorer).next_batch(1)
    assert batch.metrics["rollout/sampling_rounds"] == 3 and not batch.prompts
    # 3 rounds x 2 prompts drawn, each group's mean learned: 1.0 (easy) for prompts 0-1, 0.0 (hard)
    assert len(sampler.latest) == 6
    assert all(mean == (1.0 if i < 2 else 0.0) for i, mean in sampler.latest.items())
    assert batch.metrics["data/pool_easy"] + batch.metrics["data/pool_hard"] == 6
    assert batch.metrics["data/pool_normal"] == 2  # the two never drawn
