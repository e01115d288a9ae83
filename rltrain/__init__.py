"""rltrain: reinforcement learning for language models on torch, Ray, DeepSpeed and vLLM.

Modules moved by the stage layout (docs/changes.md) still import under their old names for one
release, with a DeprecationWarning: each old name is a module that forwards every attribute to the
new one (``from rltrain.routing import RouterTap`` is ``rltrain.models.routers.RouterTap``). Names
moved out of a module that stays (:data:`MOVED_NAMES`) are forwarded the same way from it, by the
same finder: the module itself imports nothing of their new home (the loss library stays below the
forward).
"""

from rltrain.moved import MOVED, MOVED_NAMES, install

install()
__all__ = ["MOVED", "MOVED_NAMES"]
