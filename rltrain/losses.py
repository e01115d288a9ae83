"""Public path of :mod:`rltrain.loss.losses` (the policy, value and SFT losses): the same module under its
documented name, ``from rltrain.losses import ...``."""

import sys

from rltrain.loss import losses

sys.modules[__name__] = losses
