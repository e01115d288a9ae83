"""The learner side: models trained (or scored) by Ray actors that each own a DeepSpeed engine.

- :mod:`~rltrain.learner.engine`: the engine loop every model takes (accumulation with explicit
  boundaries, the one token-total collective, one metrics all-reduce);
- :mod:`~rltrain.learner.state`: its weights, checkpoints and the Hugging Face export;
- :mod:`~rltrain.learner.policy`, :mod:`~rltrain.learner.critic`, :mod:`~rltrain.learner.sft`: what
  each trained role computes per micro-batch; :mod:`~rltrain.learner.frozen`: the frozen ones
  (teacher, reward model) on the same engine path;
- :mod:`~rltrain.learner.group`: the actors of one model, driven together;
- :mod:`~rltrain.learner.sequence_parallel` and :mod:`~rltrain.forward.attention`: packed and
  sequence-parallel attention.

The learner side never imports the rollout side or the driver (:mod:`rltrain.run`). Its main names
are reachable from here (``from rltrain.learner import LearnerGroup``) without importing ray for
the modules that do not need it.
"""

from __future__ import annotations

_EXPORTS = {
    "EngineLearner": "engine",
    "LearnerGroup": "group",
    "PolicyLearner": "policy",
    "LearnerState": "state",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"rltrain.learner.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'rltrain.learner' has no attribute {name!r}")
