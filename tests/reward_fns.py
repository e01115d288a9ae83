"""User reward functions for the scorer tests (module:function specs; no heavy imports, so the
scorer's worker processes start fast)."""

import time


def length_reward(completion, answer):
    return len(completion)


def raising_reward(completion, answer):
    raise RuntimeError("boom")


def nan_reward(completion, answer):
    return float("nan")


def hanging_reward(completion, answer):
    time.sleep(3600)


def spinning_reward(completion, answer):
    while True:
        pass


def parity_reward(completion, answer):
    # 0 or 1 at random for a random model: about half of the groups of 2 have zero variance, so
    # dynamic sampling refills the batch
    return float(len(completion) % 2)


def trl_reward(prompts, completions, answer, **kwargs):
    # TRL's batch form: every completion at once, the data's columns as lists
    return [float(c.strip() == a) + 0.5 * ("?" in p) for p, c, a in zip(prompts, completions, answer)]


def trl_reward_with_a_gap(prompts, completions, **kwargs):
    # None: the function does not apply to the completion it stands for (the second one here)
    return [1.0 if i != 1 else None for i in range(len(completions))]


def divide_by_zero_reward(completion, answer):
    return len(completion) / 0


def raises_unless_right(completion, answer):
    # passes the check before the run (called with the answer as the completion); fails on the rest
    if completion.strip() != answer:
        raise ValueError(f"cannot score {completion[:10]!r}")
    return 1.0


def trl_reward_needs_level(prompts, completions, *, level, **kwargs):
    # names a column (level) the built-in data does not have
    return [float(level[i]) for i in range(len(completions))]


def string_reward(completion, answer):
    return "1.0"  # a number's text, not a number


def bool_reward(completion, answer):
    return completion == answer


def digits_task_reward(completion, answer):
    # a multi-task reward's part, as TRL writes them: None where the sample is not its task's
    return float(completion == answer) if completion.isdigit() else None


def words_task_reward(completion, answer):
    return float(completion == answer) if completion.isalpha() else None


def tied_reward(completion, answer):
    # a group whose answer is even ties (every completion 1: advantage 0, its gradient zero); the
    # others score a completion's length parity (mixed, for a random model)
    return 1.0 if int(answer) % 2 == 0 else float(len(completion) % 2)
