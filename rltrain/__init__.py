"""rltrain: reinforcement learning for language models on torch, Ray, DeepSpeed and vLLM.

Modules moved by the stage layout (docs/changes.md) still import under their old names for one
release, with a DeprecationWarning: each old name is a module that forwards every attribute to the
new one (``from rltrain.routing import RouterTap`` is ``rltrain.models.routers.RouterTap``).
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED = {
    "rltrain.rollout.environments": "rltrain.episodes.environments",
    "rltrain.rollout.episode_state": "rltrain.episodes.episode_state",
    "rltrain.rollout.env_host": "rltrain.episodes.env_host",
    "rltrain.rollout.episodes": "rltrain.episodes.turns",
    "rltrain.rollout.agents": "rltrain.episodes.agents",
    "rltrain.rollout.gateway": "rltrain.episodes.gateway",
    "rltrain.rollout.verifiers_env": "rltrain.episodes.verifiers_env",
    "rltrain.rollout.tools": "rltrain.episodes.tools",
    "rltrain.rollout.sandbox": "rltrain.sandbox",
    "rltrain.episodes.sandbox": "rltrain.sandbox",
    "rltrain.rollout.parsers": "rltrain.episodes.parsers",
    "rltrain.rollout.chat": "rltrain.episodes.chat",
    "rltrain.rollout.rewards": "rltrain.rewards.functions",
    "rltrain.rollout.judge": "rltrain.rewards.judge",
    "rltrain.rollout.routes": "rltrain.rollout.route_recorder",
    "rltrain.learner.routers": "rltrain.learner.route_rows",
    "rltrain.routing": "rltrain.models.routers",
    "rltrain.tiny_model": "rltrain.models.tiny",
    "rltrain.pretrained": "rltrain.models.pretrained",
    "rltrain.adapters": "rltrain.models.adapters",
    "rltrain.run.checks": "rltrain.run.preflight",
    "rltrain.loss.forwards": "rltrain.forward",
    "rltrain.loss.recurrent": "rltrain.forward.recurrent",
    "rltrain.loss.vision": "rltrain.forward.vision",
    "rltrain.loss.rows": "rltrain.forward.structure",
    "rltrain.learner.attention": "rltrain.forward.attention",
    "rltrain.run.diagnostics": "rltrain.diagnostics",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name of :data:`MOVED` and makes it a module forwarding to the new one."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} is now {MOVED[spec.name]}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        module = types.ModuleType(spec.name, f"Moved to {MOVED[spec.name]}.")
        new = importlib.import_module(MOVED[spec.name])
        module.__getattr__ = lambda attribute: getattr(new, attribute)
        return module

    def exec_module(self, module) -> None:
        pass


sys.meta_path.append(_Moved())
