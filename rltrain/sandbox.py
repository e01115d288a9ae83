"""Moved to :mod:`rltrain.rollout.sandbox` (the sandbox of the python tool), with the rest of the rollout side;
``rltrain.sandbox`` stays an alias of it for code that imports the old path."""

import sys

from rltrain.rollout import sandbox

sys.modules[__name__] = sandbox
