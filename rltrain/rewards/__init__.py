"""Scoring a completion: reward functions, built-in and the user's, run in worker processes with
deadlines (:mod:`~rltrain.rewards.functions`), and a judge model's verdicts
(:mod:`~rltrain.rewards.judge`).

It hands on one score per completion and function (None: the function does not apply); it knows
nothing of episodes, engines or learners.
"""
