"""The old names of moved modules and of names moved out of a module that stays, forwarded for one
release with a DeprecationWarning by one import finder (installed by :mod:`rltrain`'s ``__init__``)."""

import importlib
import importlib.abc
import importlib.machinery
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
# a module that stays -> (the new home of some of its names, those names)
MOVED_NAMES = {
    "rltrain.loss.logprobs": ("rltrain.forward", ("sequence_logprobs", "token_outputs", "pack_sequences",
                                                  "packed_forward", "padded_forward", "head_forward", "text_positions")),
    "rltrain.learner.prefix_tree": ("rltrain.forward.tree", ("first_index", "tree_forward", "tree_logprobs", "tree_outputs")),
}  # fmt: skip


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module name of :data:`MOVED` and makes it a module forwarding to the new one;
    a module of :data:`MOVED_NAMES` loads as it is, its moved names forwarded."""

    def find_spec(self, name, path=None, target=None):
        if name in MOVED_NAMES:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None:
                spec.loader = _Forwarding(spec.loader, name)
            return spec
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


class _Forwarding(importlib.abc.Loader):
    """A module's own loader; once it ran, the module's moved names (:data:`MOVED_NAMES`) forward to
    their new home, with a DeprecationWarning."""

    def __init__(self, loader, name: str):
        self.loader, self.name = loader, name

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        home, names = MOVED_NAMES[self.name]

        def moved(attribute: str):
            if attribute not in names:
                raise AttributeError(f"module {self.name!r} has no attribute {attribute!r}")
            warnings.warn(f"{self.name}.{attribute} is now {home}.{attribute}; the old name goes in the next "
                          "release", DeprecationWarning, stacklevel=2)  # fmt: skip
            return getattr(importlib.import_module(home), attribute)

        module.__getattr__ = moved


def install() -> None:
    """Put the finder first on the import path (once)."""
    if not any(isinstance(f, _Moved) for f in sys.meta_path):
        sys.meta_path.insert(0, _Moved())
