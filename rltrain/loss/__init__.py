"""The loss library: pure torch, the one collective that sums a step's token totals aside.

- :mod:`~rltrain.loss.masked_mean`: masked means, the per-sequence aggregations, and the token
  totals of an optimizer step (public path: ``rltrain.loss.masked_mean``);
- :mod:`~rltrain.loss.losses`: the policy (PPO, CISPO, GSPO, DPPO), value and SFT losses, returning
  token sums over a denominator given from outside (public path: ``rltrain.loss.losses``);
  :mod:`~rltrain.loss.dppo`: DPPO's divergence mask;
- :mod:`~rltrain.loss.advantages`: group-relative advantages and GAE;
- :mod:`~rltrain.loss.logprobs`: per-token log-probs and entropy, padded or packed;
- :mod:`~rltrain.loss.corrections`: rollout corrections (truncated or masked importance sampling);
- :mod:`~rltrain.loss.moe`: the MoE load-balancing loss at step scope.

Nothing here imports another part of rltrain.
"""
