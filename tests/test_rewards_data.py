import json
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from rltrain.batch import Completion, collate
from rltrain.config import DataConfig
from rltrain.data import arithmetic_rows, load_rows, tokenize_prompts
from rltrain.models.tiny import build_tokenizer
from rltrain.plan import plan_micro_batches
from rltrain.prompt_sampler import PromptSampler
from rltrain.rewards.functions import RewardScorer, digits_reward, load_reward_fn, soft_overlong_penalty

FNS = "reward_fns"


def test_builtin_rewards():
    with RewardScorer({"math": 1.0, "exact_match": 1.0, "format": 1.0}, timeout_s=5) as scorer:
        scores = scorer(["so the answer is \\boxed{12}", "12", "eleven"], ["12", "12", "12"])
    # math: 1, 1, 0; exact: 0, 1, 0; format (ends in \boxed{}): 1, 0, 0
    assert scores.rewards == [2.0, 2.0, 0.0]
    assert scores.per_function == pytest.approx({"math": 2 / 3, "exact_match": 1 / 3, "format": 1 / 3})
    # digits: "a1 2" has visible characters a, 1, 2 -> 2/3
    assert digits_reward("a1 2", "") == pytest.approx(2 / 3)


def test_user_reward_function_and_failures_score_zero_and_are_counted():
    functions = {f"{FNS}:length_reward": 0.5, f"{FNS}:raising_reward": 1.0, f"{FNS}:nan_reward": 1.0}
    with RewardScorer(functions, timeout_s=5) as scorer:
        scores = scorer(["abcd", "xy"], ["", ""])
    # only length_reward counts: 0.5 * 4, 0.5 * 2; raising_reward fails on both samples, and
    # nan_reward's NaN is "does not apply" (TRL's None), no failure where another function applies
    assert scores.rewards == [2.0, 1.0]
    assert scores.failures == 2 and scores.failed == [f"{FNS}:raising_reward"] * 2
    assert scores.per_sample[f"{FNS}:nan_reward"] == [None, None]


def test_a_reward_that_is_no_number_is_a_failure_and_a_bool_is_a_number():
    import numpy as np

    from rltrain.rewards.functions import score_value

    functions = {f"{FNS}:string_reward": 1.0, f"{FNS}:bool_reward": 1.0}
    with RewardScorer(functions, timeout_s=5) as scorer:
        scores = scorer(["12", "13"], ["12", "12"])
    # "1.0" fails both calls (it scored 1.0 before); the bool scores 1 and 0
    assert scores.rewards == [1.0, 0.0] and scores.failures == 2
    assert "returned '1.0' (str), not a number" in scores.calls[f"{FNS}:string_reward"].first_error
    assert [score_value(v) for v in (np.float32(0.5), np.int64(2), True, None, float("nan"))] == [
        0.5, 2.0, 1.0, None, None]  # fmt: skip
    for wrong in ("1.0", [1.0], {"score": 1}):
        with pytest.raises(TypeError, match="not a number"):
            score_value(wrong)


def test_a_reward_function_named_by_its_file_is_logged_by_its_name_not_its_path(tmp_path):
    from rltrain.rewards.functions import reward_name
    from rltrain.run.scoring import user_code_calls

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "myreward.py").write_text("def reverse_reward(c, a):\n    raise ValueError(c)\n")
    spec = f"{tmp_path}/sub/myreward.py:reverse_reward"
    with RewardScorer({spec: 1.0, "math": 1.0}, timeout_s=5) as scorer:
        scores = scorer(["12"], ["12"])
    assert set(scores.per_function) == {"myreward:reverse_reward", "math"}  # reward/myreward:reverse_reward
    assert set(user_code_calls([], scores.calls)) == {
        "reward function myreward:reverse_reward",
        "reward function math",
    }
    assert (
        reward_name("reward_fns:parity_reward") == "reward_fns:parity_reward"
        and reward_name("math") == "math"
    )


def workers() -> list[psutil.Process]:
    """The scorer's worker processes: spawned children of this process (not multiprocessing's
    resource tracker, which lives as long as we do, nor a Ray instance another test started)."""
    children = [(p, " ".join(p.cmdline())) for p in psutil.Process().children()]
    return [p for p, cmd in children if "spawn_main" in cmd and "resource_tracker" not in cmd]


def test_the_main_module_a_spawned_reward_worker_reimports_is_light():
    # a spawned worker runs its parent's main module first: rltrain.train under `python -m
    # rltrain.train`, as multiprocessing does it (runpy, as __mp_main__); that must not load the
    # trainer's stack (4 CPU-seconds a worker with torch, transformers and Ray; 0.6 s without)
    code = ("import runpy, sys; runpy.run_module('rltrain.train', run_name='__mp_main__'); "
            "print(sorted(m for m in ('torch', 'transformers', 'ray', 'deepspeed', 'vllm') if m in sys.modules))")  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def quiet(processes: list[psutil.Process], within_s: float) -> bool:
    """True once none of them uses a CPU (a hung call still running would spin or sleep forever)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all(p.cpu_percent(interval=0.3) < 20 for p in processes if p.is_running()):
            return True
    return False


@pytest.mark.parametrize("hang", ["hanging_reward", "spinning_reward"])
def test_a_reward_call_past_its_deadline_is_killed_with_its_worker(hang):
    with RewardScorer({f"{FNS}:{hang}": 1.0, f"{FNS}:length_reward": 1.0}, timeout_s=0.5) as scorer:
        scorer(["warm"], [""])  # workers started (and the first hung ones replaced)
        threads = threading.active_count()
        for _ in range(3):  # every round hangs two calls: without killing, they would pile up
            scores = scorer(["abc", "de"], ["", ""])
            assert scores.rewards == [3.0, 2.0] and scores.failures == 2
        # six calls hung in all; what is alive is the two workers, idle
        alive = workers()
        assert 1 <= len(alive) <= 2, alive  # (one may be between a kill and its replacement)
        assert quiet(alive, within_s=20)
        assert threading.active_count() == threads  # no hung call left running here either
    assert not workers()  # closed: nothing left running


LATE_WORKERS = """
import os, sys, time
if __name__ == "__mp_main__":  # a reward worker starting: the first one is quick, the others slow
    try:
        os.close(os.open(sys.argv[1], os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        time.sleep(1.0)
import pebble.pool.process
from rltrain.rewards.functions import RewardScorer
stop = pebble.pool.process.stop_process
def slow_stop(process):  # a loaded machine: each worker takes a while to stop
    time.sleep(1.0)
    stop(process)
pebble.pool.process.stop_process = slow_stop
if __name__ == "__main__":
    with RewardScorer({"digits": 1.0}, timeout_s=5, workers=3) as scorer:
        print(scorer(["3"], ["3"]).rewards)
"""


def test_a_scorer_closed_while_its_workers_start_waits_for_them_and_prints_nothing(tmp_path):
    # the quick worker scores the call and the scorer closes at once, while the other two still
    # start; stopped then, they would wake to their start-up state's semaphores gone (the stopping
    # pool released them) and each print a FileNotFoundError traceback over the run's last line
    script = tmp_path / "late_workers.py"
    script.write_text(LATE_WORKERS)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "first")],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "[1.0]\n", "")


@pytest.mark.parametrize("spec", ["nope", "no_such_module:f", "json:no_such_fn", "json:__doc__"])
def test_bad_reward_spec(spec):
    with pytest.raises(ValueError):
        load_reward_fn(spec)


def test_soft_overlong_penalty():
    # max 20, buffer 4: no penalty up to 16 tokens, then -0.5 * (len - 16) / 4
    assert soft_overlong_penalty(16, 20, 4, 0.5) == 0.0
    assert soft_overlong_penalty(18, 20, 4, 0.5) == pytest.approx(-0.25)
    assert soft_overlong_penalty(20, 20, 4, 0.5) == pytest.approx(-0.5)


def test_local_jsonl_and_missing_column(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"q{i}", "solution": i}) for i in range(3)))
    rows = load_rows(DataConfig(source=str(path), prompt_key="question", answer_key="solution"))
    assert rows[2] == {"prompt": "q2", "answer": "2"}
    with pytest.raises(ValueError, match=r"train.jsonl line 1 has no column 'prompt' \(data.prompt_key\)"):
        load_rows(DataConfig(source=str(path), answer_key="solution"))


def test_answer_pattern_extracts_the_final_answer(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "3 + 4 = 7\n#### 7"}))
    config = DataConfig(source=str(path), prompt_key="question", answer_pattern="#### (.+)$")
    assert load_rows(config) == [{"prompt": "q", "answer": "7"}]
    with pytest.raises(ValueError, match="does not match the answer of gsm.jsonl line 1"):
        load_rows(config.model_copy(update={"answer_pattern": "@@ (.+)"}))
    with pytest.raises(ValueError, match="needs one"):
        DataConfig(answer_pattern="####")


def test_prompts_are_chat_templated_and_too_long_prompts_rejected():
    tokenizer = build_tokenizer()
    prompts = tokenize_prompts(arithmetic_rows(4), tokenizer, DataConfig(system_prompt="Be brief."))
    text = tokenizer.decode(prompts[0].token_ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is")
    assert text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="over data.max_prompt_tokens=5"):
        tokenize_prompts(arithmetic_rows(1), tokenizer, DataConfig(max_prompt_tokens=5))


def test_sampler_resumes_the_same_order():
    prompts = tokenize_prompts(arithmetic_rows(10), build_tokenizer(), DataConfig())
    a = PromptSampler(prompts, seed=3)
    a.take(7)
    state = a.state()
    expected = [p.index for p in a.take(8)]  # crosses into the second shuffled pass
    b = PromptSampler(prompts, seed=3)
    b.load_state(state)
    assert [p.index for p in b.take(8)] == expected
    assert len(set(expected[:3])) == 3


def test_collate_aligns_prompts_completions_and_masks():
    c1 = Completion(token_ids=[7, 8, 9], logprobs=[-1.0, 0.0, -3.0], tool_mask=[1, 0, 1])
    c2 = Completion(token_ids=[5], logprobs=[-2.0], tool_mask=[1], finish_reason="length")
    batch = collate(
        [[1, 2], [3]], [c1, c2], torch.tensor([0.5, -0.5]), pad_id=0, exclude_from_loss=[False, True]
    )
    # prompt columns 0-1 (left-padded), completion columns 2-4 (right-padded)
    assert batch.input_ids.tolist() == [[1, 2, 7, 8, 9], [0, 3, 5, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]  # sequence 2 excluded
    assert batch.tool_mask.tolist() == [[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]]
    assert batch.generator_logprobs.tolist() == [[0, 0, -1, 0, -3], [0, 0, -2, 0, 0]]
    batch.validate()


@pytest.mark.parametrize(
    ("n", "world", "mini", "mbs"), [(7, 2, 1, 3), (8, 3, 2, 2), (5, 4, 1, 1), (9, 2, 3, 4)]
)
def test_micro_batch_plan_keeps_every_sequence_once_and_ranks_in_lockstep(n, world, mini, mbs):
    plan = plan_micro_batches(n, world, mini, mbs).groups
    seen = sorted(i for rank in plan for group in rank for mb in group for i in mb.tolist())
    assert seen == list(range(n))  # nothing dropped, nothing twice
    shape = [len(group) for group in plan[0]]
    assert all([len(group) for group in rank] == shape for rank in plan)  # same collectives on every rank
    assert len(set(shape)) == 1 and len(shape) == mini  # one accumulation length for every group
    assert all(len(mb) <= mbs for rank in plan for group in rank for mb in group)


def test_micro_batch_plan_pads_short_shares_with_empty_micro_batches():
    # 7 sequences, 2 ranks, micro-batches of 3: shares 0-3 and 4-6 -> rank 0 (3, 1), rank 1 (3, empty)
    plan = plan_micro_batches(7, 2, 1, 3).groups
    assert [[mb.tolist() for mb in group] for group in plan[0]] == [[[0, 1, 2], [3]]]
    assert [[mb.tolist() for mb in group] for group in plan[1]] == [[[4, 5, 6], []]]


def test_trls_batch_form_is_told_apart_by_its_signature_and_gets_the_data_columns():
    # trl_reward(prompts, completions, answer, **kwargs): one call for the batch; +0.5 where the
    # prompt asks a question; trl_reward_with_a_gap's None: it does not apply to the second
    # completion (TRL's meaning), which trl_reward still scores: no failure
    functions = {f"{FNS}:trl_reward": 1.0, f"{FNS}:trl_reward_with_a_gap": 1.0}
    with RewardScorer(functions, timeout_s=5) as scorer:
        assert scorer.batch == set(functions)
        columns = {"prompts": ["What is 2 + 3?", "Say 7."], "level": [1, 2]}
        scores = scorer([" 5", "8"], ["5", "7"], columns=columns)
    # completion 0: 1 (right) + 0.5 (a question) + 1; completion 1: 0 + 0 (the gap's function skipped)
    assert scores.rewards == [2.5, 0.0]
    assert scores.failures == 0 and scores.failed == [None, None]
    gap = scores.calls[f"{FNS}:trl_reward_with_a_gap"]
    assert (gap.called, gap.failed, gap.first_error) == (2, 0, None)
    assert scores.per_sample[f"{FNS}:trl_reward_with_a_gap"] == [1.0, None]
    assert scores.per_function[f"{FNS}:trl_reward_with_a_gap"] == 1.0  # over the one it applies to


def test_a_multi_task_reward_sums_the_functions_that_apply_and_fails_only_where_none_does():
    # each function scores its own task type and returns None on the others (TRL's convention)
    digits, words = f"{FNS}:digits_task_reward", f"{FNS}:words_task_reward"
    with RewardScorer({digits: 1.0, words: 2.0}, timeout_s=5) as scorer:
        scores = scorer(["7", "seven", "?", "8"], ["7", "seven", "?", "7"])
    # "7": digits 1 (right), words None -> 1; "seven": digits None, words 1 x weight 2 -> 2;
    # "?": neither applies -> failed, 0; "8": digits 0 (wrong), words None -> 0, not failed
    assert scores.rewards == [1.0, 2.0, 0.0, 0.0]
    assert scores.failed == [None, None, digits, None]
    assert scores.failures == 2  # the two Nones of "?", where no function applied
    assert scores.per_function == {digits: 0.5, words: 1.0}  # digits: (1 + 0) / 2; words: 1 / 1
    assert scores.calls[digits].failed == scores.calls[words].failed == 1
    assert "no other reward function applies" in scores.calls[digits].first_error
    with RewardScorer({digits: 1.0}, timeout_s=5) as scorer:  # one function: its None is a failure
        assert scorer(["seven"], ["seven"]).failed == [digits]


def test_preflight_takes_a_multi_task_reward_whose_first_row_one_function_does_not_apply_to():
    from rltrain.rewards.functions import check_reward_functions

    digits, words = f"{FNS}:digits_task_reward", f"{FNS}:words_task_reward"
    row = {"prompt": "What is 3 + 4?", "answer": "7"}
    check_reward_functions({digits: 1.0, words: 1.0}, 5.0, row)
    with pytest.raises(ValueError, match=rf"^reward.functions: {words} returned no score \(None or NaN\) "
                       "on the first data row with its answer as the completion: no function applies to it$"):  # fmt: skip
        check_reward_functions({words: 1.0}, 5.0, row)


def test_a_failing_reward_function_keeps_its_first_traceback():
    with RewardScorer(
        {f"{FNS}:divide_by_zero_reward": 1.0, f"{FNS}:length_reward": 1.0}, timeout_s=5
    ) as scorer:
        scores = scorer(["ab", "c"], ["", ""])
    failing = scores.calls[f"{FNS}:divide_by_zero_reward"]
    assert (failing.called, failing.failed) == (2, 2)
    assert "Traceback" in failing.first_error and "ZeroDivisionError: division by zero" in failing.first_error
    assert "return len(completion) / 0" in failing.first_error  # the user's own line
    assert scores.calls[f"{FNS}:length_reward"].failed == 0


def test_a_reward_function_from_a_file_path_and_the_hint_for_a_module_not_on_the_path(tmp_path, monkeypatch):
    (tmp_path / "myreward.py").write_text(
        "def shout(completion, answer):\n    return float(completion.isupper())\n"
    )
    monkeypatch.chdir(tmp_path)
    with RewardScorer({"myreward.py:shout": 1.0}, timeout_s=5) as scorer:  # relative to the working folder
        assert scorer(["YES", "no"], ["", ""]).rewards == [1.0, 0.0]
    with pytest.raises(
        ValueError, match=r"No module named 'nowhere_reward'.*PYTHONPATH.*path/to/nowhere_reward\.py:f"
    ):
        load_reward_fn("nowhere_reward:f")


def test_builtin_arithmetic_mixes_questions_of_the_operand_lengths_asked_for():
    from rltrain.config import EvalConfig
    from rltrain.data import split_held_out

    data = DataConfig(task_config={"digits": [1, 3]})
    rows = load_rows(data)
    lengths = [{len(x) for x in re.match(r"What is (\d+) [+-] (\d+)", r["prompt"]).groups()} for r in rows]
    assert {frozenset(n) for n in lengths} == {frozenset({1}), frozenset({3})}  # both operands alike
    assert 0.4 < sum(n == {1} for n in lengths) / len(rows) < 0.6  # drawn per question, half each
    assert all(int(r["answer"]) == eval(r["prompt"][8:].split("?")[0]) for r in rows[:50])
    _, held = split_held_out(rows, data, EvalConfig(num_prompts=50))
    # there are 10 x 10 x 2 = 200 one-digit questions and ~1024 draws of them among the training
    # rows: every one is a training question, so the held-out questions are the three-digit ones
    assert {len(re.match(r"What is (\d+)", r["prompt"])[1]) for r in held} == {3}
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in rows}
    assert load_rows(DataConfig()) == load_rows(DataConfig(task_config={}))  # the default task: 0-50


def test_reasoning_gym_rows_their_held_out_questions_and_the_datasets_own_scorer():
    from rltrain.config import EvalConfig
    from rltrain.data import split_held_out
    from rltrain.tasks import extract_answer, reasoning_gym_reward

    data = DataConfig(
        source="reasoning_gym:chain_sum", size=50, seed=3, task_config={"min_terms": 2, "max_terms": 2}
    )
    rows = load_rows(data)
    assert len(rows) == 50 and rows == load_rows(data)  # the seed fixes them
    train, held = split_held_out(rows, data, EvalConfig(num_prompts=8))
    assert train == rows and len(held) == 8
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in rows}  # another seed, none shared
    row = rows[0]
    right = json.loads(row["answer"])["answer"]
    wrong = str(int(right) + 1)
    # the last <answer> tag, else the last \boxed{}, else the last non-empty line
    assert extract_answer(f"<answer>{wrong}</answer> no: <answer> {right} </answer>\nbye") == right
    assert extract_answer(f"so \\boxed{{{right}}}") == right
    assert extract_answer(f"thinking\n{right}\n\n") == right
    assert reasoning_gym_reward(f"<answer>{right}</answer>", row["answer"]) == 1.0
    assert reasoning_gym_reward(f"<answer>{wrong}</answer>", row["answer"]) == 0.0
    assert load_reward_fn("reasoning_gym") is reasoning_gym_reward


def test_a_composite_reasoning_gym_source_mixes_its_datasets_and_scores_each_by_its_own():
    from rltrain.tasks import reasoning_gym_reward

    data = DataConfig(source="reasoning_gym:composite", size=40, seed=1,
                      task_config={"datasets": [{"name": "chain_sum", "weight": 3}, {"name": "gcd", "weight": 1}]})  # fmt: skip
    entries = [json.loads(r["answer"]) for r in load_rows(data)]
    names = [e["metadata"]["source_dataset"] for e in entries]
    assert set(names) == {"chain_sum", "gcd"} and names.count("chain_sum") > names.count("gcd")
    gcd = next(r for r, n in zip(load_rows(data), names) if n == "gcd")
    assert reasoning_gym_reward(json.loads(gcd["answer"])["answer"], gcd["answer"]) == 1.0  # the last line


def test_difficulty_sampling_draws_each_pool_by_its_weight_and_resumes_as_it_went():
    from rltrain.config import DifficultySampling
    from rltrain.data import Prompt

    prompts = [Prompt(i, [1], "") for i in range(30)]
    # prompts 0-9 always solved (easy), 10-19 never (hard), 20-29 half the time (normal)
    means = [1.0] * 10 + [0.0] * 10 + [0.5] * 10
    pools = {i: "easy" if i < 10 else "hard" if i < 20 else "normal" for i in range(30)}
    sampler = PromptSampler(prompts, seed=1, difficulty=DifficultySampling(easy_weight=0.0, hard_weight=1.0))
    sampler.observe(prompts, means)
    assert sampler.pool_sizes() == {
        "data/pool_hard": 10.0,
        "data/pool_normal": 10.0,
        "data/pool_easy": 10.0,
        "data/pool_fallback_draws": 0.0,
    }
    first = [p.index for p in sampler.take(20)]
    # easy weighs 0: set aside for the epoch; hard and normal weigh 1 each, each prompt once a pass
    assert sorted(first) == list(range(10, 30))
    assert 3 <= sum(pools[i] == "hard" for i in first[:10]) <= 7  # drawn by weight, not pool by pool
    # mid-epoch state (a checkpoint), then a prompt's mean changes: the resumed sampler draws the same
    sampler.observe(prompts[20:21], [1.0])  # prompt 20 is now easy: left for the epoch's end
    state = json.loads(json.dumps(sampler.state()))  # (through the checkpoint's JSON)
    expected = [p.index for p in sampler.take(25)]
    resumed = PromptSampler(prompts, seed=1, difficulty=DifficultySampling(easy_weight=0.0, hard_weight=1.0))
    resumed.load_state(state)
    assert [p.index for p in resumed.take(25)] == expected
    assert 20 not in expected  # easy now, weight 0
    # without weights that differ: the plain sampler's order is kept (same draws as before the option)
    plain = PromptSampler(prompts, seed=1)
    assert [p.index for p in plain.take(30)] == [p.index for p in PromptSampler(prompts, seed=1).take(30)]


def test_difficulty_sampling_without_a_prompt_in_a_pool_of_positive_weight_falls_back_and_says_so(capsys):
    import threading

    from rltrain.config import DifficultySampling
    from rltrain.data import Prompt

    # every prompt solved and easy_weight 0: no pool of positive weight holds a prompt, in this pass
    # or a fresh one (the sampler reshuffled forever); draws take the epoch's order, said once
    prompts = [Prompt(i, [1], "") for i in range(5)]
    sampler = PromptSampler(prompts, seed=2, difficulty=DifficultySampling(easy_weight=0.0))
    sampler.observe(prompts, [1.0] * 5)
    drawn: list[int] = []
    worker = threading.Thread(target=lambda: drawn.extend(p.index for p in sampler.take(12)), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "the sampler never returned"
    assert sorted(drawn[:5]) == list(range(5)) and sorted(drawn[5:10]) == list(range(5))  # passes in order
    assert sampler.pool_sizes()["data/pool_fallback_draws"] == 12
    out = capsys.readouterr().out.strip()
    assert "no prompt is in a pool of positive weight" in out and "\n" not in out
    # once a prompt is normal again, draws take it by the weights as before
    sampler.observe(prompts[:1], [0.5])
    assert [p.index for p in sampler.take(2)] == [0, 0]  # (the only positive pool's one prompt, a pass each)
    assert sampler.pool_sizes()["data/pool_fallback_draws"] == 12


def test_a_difficulty_draw_costs_no_pass_over_every_prompt():
    from rltrain.config import DifficultySampling
    from rltrain.data import Prompt

    # 500k prompts, 512 draws a step: each draw looked at every prompt's pool (about 1e8 Python
    # steps a step); a draw now looks at a few heap heads. Counted: the pool lookups of 512 draws
    n = 500_000
    prompts = [Prompt(i, [], "") for i in range(n)]
    sampler = PromptSampler(prompts, seed=0, difficulty=DifficultySampling(easy_weight=0.0))
    sampler.observe(prompts[: n // 2], [1.0, 0.0] * (n // 4))  # a quarter easy, a quarter hard
    lookups, pool = [0], sampler.pool

    def counted(index: int) -> str:
        lookups[0] += 1
        return pool(index)

    sampler.pool = counted
    drawn = sampler.take(512)
    assert len({p.index for p in drawn}) == 512 and all(pool(p.index) != "easy" for p in drawn)
    assert lookups[0] < 20 * 512, lookups[0]


def test_a_pass_over_a_pool_of_few_prompts_costs_those_prompts_not_every_prompt():
    # 100k prompts, all solved (easy, weighed 0) but two: every second draw ends the epoch. A fresh
    # epoch reshuffled and re-pooled every prompt (O(N log N) a draw: ~1e7 pool lookups for 200
    # draws); it now orders the pools it draws from. Counted: the pool lookups
    from rltrain.config import DifficultySampling
    from rltrain.data import Prompt
    from rltrain.prompt_sampler import Permutation

    n = 100_000
    prompts = [Prompt(i, [], "") for i in range(n)]
    sampler = PromptSampler(prompts, seed=0, difficulty=DifficultySampling(easy_weight=0.0))
    sampler.observe(prompts, [0.5 if i in (7, 8) else 1.0 for i in range(n)])
    lookups, pool = [0], sampler.pool

    def counted(index: int) -> str:
        lookups[0] += 1
        return pool(index)

    sampler.pool = counted
    drawn = [p.index for p in sampler.take(200)]
    assert sorted(drawn[:2]) == [7, 8] and sorted(drawn) == [7] * 100 + [8] * 100 and sampler.epoch == 99
    assert lookups[0] < 20 * 200, lookups[0]
    # the epoch's order: a permutation of every prompt, evaluated where asked, either way
    permutation = Permutation(1000, seed=5)
    places = [permutation(i) for i in range(1000)]
    assert sorted(places) == list(range(1000)) and places != list(range(1000))
    assert all(permutation.inverse(place) == i for i, place in enumerate(places))


def test_a_difficulty_weight_of_zero_on_a_pool_never_draws_it_and_bad_bounds_are_refused():
    from rltrain.config import ConfigError, DifficultySampling, load_config
    from rltrain.data import Prompt

    prompts = [Prompt(i, [1], "") for i in range(6)]
    sampler = PromptSampler(prompts, seed=0, difficulty=DifficultySampling(hard_weight=0.0))
    sampler.observe(prompts[:3], [0.0, 0.1, 0.25])  # at or below hard_at=0.25: hard
    assert {p.index for p in sampler.take(12)} == {3, 4, 5}  # four passes over the normal three
    with pytest.raises(ConfigError, match="easy_at=0.2 must be above hard_at=0.25"):
        load_config(None, ["data.difficulty_sampling={easy_at: 0.2}"])
