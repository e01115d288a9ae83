"""The Tinker API's built-in losses, as its SDK documents them: **sums over tokens**, each token
weighted by the datum's own inputs, no mean and no normalization (pure torch). A
``forward_backward`` call's gradient is the gradient of its sum; several calls before one
``optim_step`` add theirs. That is how the served learners keep Tinker's semantics exactly under any
split of the data over micro-batches and ranks (:mod:`rltrain.learner.served`): a sum needs no
denominator, so none is counted, and the layout's own divisions (DeepSpeed's mean over ranks) are
undone where the learner backpropagates.

With ``target_logprobs`` the model's log-probs of the targets, ``sampling_logprobs`` the datum's
``logprobs`` (the sampler's) and ``A`` its ``advantages``, per token:

- ``cross_entropy``: ``-weights * target_logprobs``;
- ``importance_sampling``: ``-exp(target_logprobs - sampling_logprobs) * A``;
- ``ppo``: ``-min(r * A, clip(r, low, high) * A)``, ``r`` the same ratio; ``low``/``high`` from
  ``loss_fn_config`` (``clip_low_threshold``, ``clip_high_threshold``; 0.8 and 1.2, Tinker's fixed
  0.2, where not given) or per token from the datum's inputs of the same names;
- ``cispo``: ``-stopgrad(clip(r, low, high)) * target_logprobs * A``, its thresholds given;
- ``dro``: ``-(target_logprobs * A - beta / 2 * (target_logprobs - sampling_logprobs) ** 2)``,
  ``beta`` given.

Where Tinker's documentation names no default (CISPO's thresholds, DRO's beta) the setting is
required: a loss computed with a guessed constant would be a partial compatibility, silently.
"""

from __future__ import annotations

import torch

# each loss: the datum inputs it reads (beyond target_tokens), those it may read, its config keys
INPUTS = {
    "cross_entropy": (("weights",), ()),
    "importance_sampling": (("logprobs", "advantages"), ()),
    "ppo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
    "cispo": (("logprobs", "advantages"), ("clip_low_threshold", "clip_high_threshold")),
    "dro": (("logprobs", "advantages"), ()),
}
CONFIG = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": None, "clip_high_threshold": None},
    "dro": {"beta": None},
}


# losses Tinker names whose objective it does not publish (its docs give their inputs, not their
# formula): refused with why, never approximated
UNPUBLISHED = {
    "stable_reinforce": "Tinker documents what StableReinforce takes (sequence_ids of samples recorded with "
    "record_stability_info) but not its objective, so it is not served (importance_sampling is the "
    "REINFORCE with importance weights that is)",
}


def settings(loss_fn: str, config: dict | None, per_token: set[str] = frozenset()) -> dict[str, float]:
    """``loss_fn``'s settings from ``loss_fn_config``: each key it takes, given or its default
    (``per_token``: keys the datums give token by token instead, not required here); an unknown
    loss, an unknown key, a missing required one or a value that is no number raises a ValueError
    naming it (the server answers it as the caller's error)."""
    if loss_fn in UNPUBLISHED:
        raise ValueError(f"loss_fn {loss_fn!r}: {UNPUBLISHED[loss_fn]}; served: {', '.join(CONFIG)}")
    if loss_fn not in CONFIG:
        raise ValueError(
            f"loss_fn {loss_fn!r} is not served (served: {', '.join(CONFIG)}; custom losses run on the client "
            "through forward_backward_custom)"
        )
    config = dict(config or {})
    unknown = sorted(set(config) - set(CONFIG[loss_fn]))
    if unknown:
        raise ValueError(
            f"loss_fn_config {unknown} is not a setting of {loss_fn} (it takes {sorted(CONFIG[loss_fn])})"
        )
    out = {}
    for key, default in CONFIG[loss_fn].items():
        value = config.get(key, default)
        if value is None and key in per_token:
            continue
        if value is None:
            raise ValueError(f"{loss_fn} needs loss_fn_config[{key!r}] (Tinker documents no default for it)")
        if isinstance(value, str) or value != value:
            raise ValueError(f"loss_fn_config[{key!r}] = {value!r} is not a number")
        out[key] = float(value)
    return out


def token_losses(
    loss_fn: str,
    target_logprobs_BT: torch.Tensor,
    inputs: dict[str, torch.Tensor],
    settings_: dict[str, float],
) -> torch.Tensor:
    """``[B, T]`` each token's loss (0 where the datum has no token: pass a 0 ``mask`` in
    ``inputs``); their sum is the loss ``forward_backward`` backpropagates. ``inputs``: the datums'
    ``loss_fn_inputs`` as ``[B, T]`` tensors, and ``mask``."""
    mask = inputs["mask"]
    lp = target_logprobs_BT
    if loss_fn == "cross_entropy":
        return -inputs["weights"] * lp * mask
    advantages, sampled = inputs["advantages"], inputs["logprobs"]
    if loss_fn == "dro":
        return -(lp * advantages - 0.5 * settings_["beta"] * (lp - sampled) ** 2) * mask
    # (masked before the exponent: a padding cell's ratio is exp(0) = 1, never inf)
    ratio = torch.exp(torch.where(mask.bool(), lp - sampled, torch.zeros_like(lp)))
    if loss_fn == "importance_sampling":
        return -ratio * advantages * mask
    low, high = (
        inputs[k] if k in inputs else torch.full_like(lp, settings_[k])
        for k in ("clip_low_threshold", "clip_high_threshold")
    )  # (per token, or the setting)
    clipped = torch.minimum(torch.maximum(ratio, low), high)
    if loss_fn == "ppo":
        return -torch.minimum(ratio * advantages, clipped * advantages) * mask
    return -clipped.detach() * lp * advantages * mask  # cispo
