"""The rollout side, in the order the data flows:

- :mod:`~rltrain.rollout.engines`: generator actors and the pool that spreads requests over them;
  :mod:`~rltrain.rollout.backends`: the vLLM and transformers backends they own;
- :mod:`~rltrain.rollout.episodes`: one episode per request, turn by turn, token-in/token-out;
- :mod:`~rltrain.rollout.chat`: the chat template's rendering of what an environment or tool adds;
- :mod:`~rltrain.rollout.parsers`: tool calls in the model's own format (``hermes``, ``tag``);
- :mod:`~rltrain.rollout.env_host`: environments and their tools, run in worker processes with
  deadlines; the protocol itself is :mod:`rltrain.envs`;
- then :mod:`rltrain.rollout.tools` (the calculator and the sandboxed python tool) and
  :mod:`rltrain.rollout.rewards`.

Only :mod:`~rltrain.rollout.engines` and :mod:`~rltrain.rollout.backends` import ray and vllm; the names it exports are reachable from
here (``from rltrain.rollout import GeneratorPool``) without importing them for the pure modules.
"""

from __future__ import annotations

_EXPORTS = {"GeneratorActor": "engines", "GeneratorPool": "engines", "GeneratorBackend": "backends",
            "HFBackend": "backends", "VLLMBackend": "backends"}  # fmt: skip


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"rltrain.rollout.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'rltrain.rollout' has no attribute {name!r}")
