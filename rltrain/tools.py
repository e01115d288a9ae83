"""Moved to :mod:`rltrain.rollout.tools` (the calculator and the sandboxed python tool), with the rest of the rollout side;
``rltrain.tools`` stays an alias of it for code that imports the old path."""

import sys

from rltrain.rollout import tools

sys.modules[__name__] = tools
