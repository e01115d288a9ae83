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
