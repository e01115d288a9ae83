"""Public path of :mod:`rltrain.episodes.environments` (the protocol an environment subclasses,
``Environment`` and ``Step``, and the built-in environments): the same module under its documented
name, ``from rltrain.envs import Environment, Step``."""

import sys

from rltrain.episodes import environments

sys.modules[__name__] = environments
