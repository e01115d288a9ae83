"""The rollout side, in the order the data flows:

- :mod:`~rltrain.rollout.engines`: generator actors (vLLM or transformers) and the pool that spreads
  requests over them;
- :mod:`~rltrain.rollout.episodes`: one episode per request, turn by turn, token-in/token-out;
- :mod:`~rltrain.rollout.chat`: the chat template's rendering of what an environment or tool adds;
- :mod:`~rltrain.rollout.parsers`: tool calls in the model's own format (``hermes``, ``tag``);
- :mod:`~rltrain.rollout.env_host`: environments and their tools, run in worker processes with
  deadlines; the protocol itself is :mod:`rltrain.envs`;
- then :mod:`rltrain.rollout.tools` (the calculator and the sandboxed python tool) and
  :mod:`rltrain.rollout.rewards`.

Only :mod:`~rltrain.rollout.engines` imports ray and vllm; the names it exports are reachable from
here (``from rltrain.rollout import GeneratorPool``) without importing them for the pure modules.
"""

from __future__ import annotations

_ENGINES = {"GeneratorActor", "GeneratorBackend", "GeneratorPool", "HFBackend", "VLLMBackend"}


def __getattr__(name: str):
    if name in _ENGINES:
        from rltrain.rollout import engines

        return getattr(engines, name)
    raise AttributeError(f"module 'rltrain.rollout' has no attribute {name!r}")
