"""Generation: the engines that sample rollouts, as Ray actors.

- :mod:`~rltrain.rollout.engines`: generator actors and the pool that spreads requests over them;
  :mod:`~rltrain.rollout.backends` and :mod:`~rltrain.rollout.hf_backend`: the vLLM and transformers
  backends they own;
- :mod:`~rltrain.rollout.inflight`: generation in chunks, new weights taken between them;
- :mod:`~rltrain.rollout.route_recorder`: the experts a vLLM engine's routers choose (routing replay).

It hands completions with their log-probs, policy versions and routes to the run; an episode's
turns are :mod:`rltrain.episodes`'. Only :mod:`~rltrain.rollout.engines` and
:mod:`~rltrain.rollout.backends` import ray and vllm; the names they export are reachable from here
(``from rltrain.rollout import GeneratorPool``) without importing them for the pure modules.
"""

from __future__ import annotations

_EXPORTS = {"GeneratorActor": "engines", "GeneratorPool": "engines", "GeneratorBackend": "backends",
            "HFBackend": "hf_backend", "VLLMBackend": "backends"}  # fmt: skip


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"rltrain.rollout.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'rltrain.rollout' has no attribute {name!r}")
