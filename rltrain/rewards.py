"""Moved to :mod:`rltrain.rollout.rewards` (reward functions and their worker processes), with the rest of the rollout side;
``rltrain.rewards`` stays an alias of it for code that imports the old path."""

import sys

from rltrain.rollout import rewards

sys.modules[__name__] = rewards
