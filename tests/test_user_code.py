"""The user's own code failing: each kind's first traceback shown once and kept, failures counted
per step, and the run stopped when every call of a reward function or environment method fails."""

import pytest
from test_episodes import EOS, ids, play

from rltrain.rewards.functions import Calls
from rltrain.run.scoring import user_code_calls
from rltrain.run.tracking import Tracker
from rltrain.run.user_code import UserCodeFailed, UserCodeFailures

TRACE = (
    'Traceback (most recent call last):\n  File "mine.py", line 3, in f\nZeroDivisionError: division by zero'
)


def test_a_kinds_first_failure_is_shown_once_and_kept(tmp_path, capsys):
    failures = UserCodeFailures(tmp_path, max_failed_steps=None)
    for step in (1, 2):
        metrics = failures.check(
            step, {"reward function mine:f": Calls(8, 3, TRACE), "reward function ok": Calls(8)}
        )
        assert metrics == {"failures/reward_function_mine_f": 3.0}  # the one that failed, counted
    err = capsys.readouterr().err
    saved = tmp_path / "errors" / "reward_function_mine_f.txt"
    assert err.count("\n") == 1  # step 2's failures are counted, not shown again
    assert err == (f"rltrain: step 1: the reward function mine:f failed (3 of 8 calls): ZeroDivisionError: "
                   f"division by zero (traceback: {saved})\n")  # fmt: skip
    assert saved.read_text() == f"reward function mine:f, first failure at step 1:\n{TRACE}\n"


def test_every_call_failing_for_the_steps_allowed_stops_the_run_but_a_tool_never_does(tmp_path):
    failures = UserCodeFailures(tmp_path, max_failed_steps=2)
    every = {"environment step": Calls(4, 4, TRACE), "tool calculator": Calls(9, 9, TRACE)}
    failures.check(1, every)  # one step in a row: allowed
    failures.check(2, {**every, "environment step": Calls(4, 3, TRACE)})  # one call went through: reset
    failures.check(3, every)
    with pytest.raises(UserCodeFailed) as stop:
        failures.check(4, every)  # steps 3 and 4: every call of the environment's step failed
    assert str(stop.value) == (
        "step 4: every call of the environment step failed for 2 step(s) in a row (4 of 4 this step: "
        f"ZeroDivisionError: division by zero); its first traceback: {tmp_path / 'errors' / 'environment_step.txt'}; "
        "stopping (run.max_user_failure_steps=2)"
    )  # fmt: skip


def test_an_environment_that_raises_in_step_leaves_its_traceback_with_the_episode():
    # envs_for_tests:StepRaisesOnWrongAnswersEnv raises KeyError unless the turn is the answer
    turns = {0: [ids("4") + [EOS]], 1: [ids("5") + [EOS]]}
    wrong, right = play(
        "envs_for_tests:StepRaisesOnWrongAnswersEnv", turns, [{"prompt": "2 + 3?", "answer": "5"}] * 2
    )
    assert (wrong.finish_reason, wrong.errors) == ("error", {"env_raised": 1})
    assert "Traceback" in wrong.failures["environment step"]
    assert 'raise KeyError("no such move")' in wrong.failures["environment step"]  # the user's line
    assert right.failures == {} and right.env_reward == 1.0
    calls = user_code_calls([wrong, right], {})
    assert (calls["environment reset"].called, calls["environment reset"].failed) == (2, 0)
    assert (calls["environment step"].called, calls["environment step"].failed) == (2, 1)


def test_the_step_line_shows_user_code_failures(tmp_path, capsys):
    from rltrain.config import load_config

    with Tracker(tmp_path, load_config(None, ["run.steps=2"]), 0) as tracker:
        tracker.log(1, {"reward/mean": 0.5, "failures/reward_function_mine_f": 3.0, "failures/tool_x": 2.0})
        tracker.log(2, {"reward/mean": 0.5})
    out = capsys.readouterr().out + capsys.readouterr().err
    assert "step 1/2 reward 0.500 user-code failures 5" in out
    assert "step 2/2 reward 0.500\n" in out or out.rstrip().endswith("step 2/2 reward 0.500")


def test_the_step_line_shows_what_a_reward_is_the_sum_of(tmp_path, capsys):
    from rltrain.config import load_config

    config = load_config(
        None, ["run.steps=1", "reward.functions={math: 1.0, digits: 0.5}", "algorithm.overlong=soft_penalty"]
    )
    with Tracker(tmp_path, config, 0) as tracker:
        tracker.log(
            1, {"reward/mean": 0.25, "reward/math": 0.5, "reward/digits": 0.2, "reward/overlong": -0.35}
        )
    # 0.5 + 0.5 * 0.2 - 0.35 = 0.25
    assert "step 1/1 reward 0.250 (math 0.500, digits 0.200, overlong -0.350)" in capsys.readouterr().out


def test_the_step_line_says_when_most_episodes_failed_and_the_most_common_reason(tmp_path, capsys):
    from rltrain.config import load_config
    from rltrain.rewards.functions import Calls
    from rltrain.run.user_code import UserCodeFailures

    failures = UserCodeFailures(tmp_path, max_failed_steps=None)
    # 16 episodes of an agent: 11 raised, 2 more ended in a chat template error -> 13 of 16
    agent = Calls(16, 11, "Traceback (most recent call last):\n  ...\nValueError: the agent's own bug")
    template = Calls(16, 2, "the chat template raised")
    failures.check(1, {"agent": agent, "chat template": template})
    assert failures.note == "13 of 16 episodes failed, most often the agent: ValueError: the agent's own bug"
    with Tracker(tmp_path, load_config(None, ["run.steps=2"]), 0) as tracker:
        tracker.log(1, {"reward/mean": 0.0}, note=failures.note)
        failures.check(2, {"agent": Calls(16, 8, "x")})  # half is not most
        tracker.log(2, {"reward/mean": 0.5}, note=failures.note)
    out = capsys.readouterr().out
    assert "step 1/2 reward 0.000 (13 of 16 episodes failed, most often the agent: ValueError" in out
    assert "step 2/2 reward 0.500\n" in out and failures.note == ""


def test_steps_without_reward_variance_are_said_to_teach_nothing_once(tmp_path, capsys):
    from rltrain.config import load_config

    flat, varied = (
        {"reward/mean": 0.0, "rollout/zero_variance_groups": 1.0},
        {"rollout/zero_variance_groups": 0.5},
    )
    with Tracker(tmp_path, load_config(None, ["run.steps=8"]), 0) as tracker:
        for step, row in enumerate([flat, flat, varied, flat, flat, flat, flat, flat], start=1):
            tracker.log(step, row)
    out = capsys.readouterr().out
    # steps 1-2 flat, then a step with variance resets the count; steps 4-6 make three in a row
    assert out.count("nothing is learned") == 1
    assert "rltrain: step 6: every group of the last 3 steps scored the same" in out
    assert "algorithm.group_size" in out


def test_steps_with_nothing_to_train_for_failures_stop_the_run_past_the_bound(tmp_path):
    import pytest

    from rltrain.run.user_code import UserCodeFailed, UserCodeFailures

    failures = UserCodeFailures(tmp_path, max_failed_steps=2)
    failures.nothing_to_train(1, {"failures/outside_policy": 16.0})  # 1 in a row: accepted
    failures.trained()  # a step that trained resets the count
    failures.nothing_to_train(2, {"failures/outside_policy": 16.0})
    failures.nothing_to_train(3, {"rollout/stale_dropped": 16.0})  # skipped, but not for failures: resets
    failures.nothing_to_train(4, {"failures/outside_policy": 16.0})
    with pytest.raises(UserCodeFailed, match=r"^step 5: every sample of 2 step\(s\) in a row failed outside the "
                       r"policy, nothing to train on \(16 failed this step\); stopping \(run.max_user_failure_steps=2"):  # fmt: skip
        failures.nothing_to_train(5, {"failures/outside_policy": 16.0})
