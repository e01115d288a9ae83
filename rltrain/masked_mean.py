"""Public path of :mod:`rltrain.loss.masked_mean` (masked means and the token totals of an optimizer step): the same module under its
documented name, ``from rltrain.masked_mean import ...``."""

import sys

from rltrain.loss import masked_mean

sys.modules[__name__] = masked_mean
