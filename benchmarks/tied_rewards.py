"""Reward functions the benchmarks name as ``tied_rewards:<name>`` (this folder on the path)."""


def tied_reward(completion, answer):
    """A group whose answer is even ties (every completion 1: advantage 0); the others score a
    completion's length parity (mixed for a random model)."""
    return 1.0 if int(answer) % 2 == 0 else float(len(completion) % 2)
