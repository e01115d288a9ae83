"""The value model of PPO with a learned critic: a scalar head per token, trained on the learners'
shared engine path (:class:`rltrain.learner.engine.EngineLearner`: DeepSpeed ZeRO 0-3, accumulation
boundaries, the one token-total collective, packing, checkpoints, Hugging Face export).

``values[:, t]`` is the value of the state before token ``t``: the head's output at position
``t - 1``, which has seen exactly the tokens before ``t``. The value loss
(:func:`rltrain.loss.losses.value_loss`) is reduced with the same denominators as the policy loss, so
in ``token`` mode the critic's update does not depend on its layout either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rltrain import forward
from rltrain.batch import TrainBatch
from rltrain.config import Config, LearnerConfig
from rltrain.learner.engine import EngineLearner
from rltrain.learner.start import load_scalar_head
from rltrain.loss.losses import question_sums, value_loss


class CriticLearner(EngineLearner):
    ROLE = "critic learner"
    KEY = "critic.learners"
    PREFIX = "critic"
    PERF = "critic_"
    # "residual" is return - value at rollout time, for the explained variance
    METRIC_SUMS = [
        "value_loss",
        "value_clipped",
        "value",
        "return",
        "return_sq",
        "residual",
        "residual_sq",
        "tokens",
    ]
    # per sample at its question (the state before its first sampled token): (samples, sum of
    # returns, of their squares, of the residuals return - value, of their squares)
    METRIC_TOTALS = {"question": 5}

    @staticmethod
    def section(config: Config) -> LearnerConfig:
        return config.critic.learners

    def _build_model(self) -> torch.nn.Module:
        # a new value head starts at 0: every state's value is 0 until the critic has learned
        return load_scalar_head(self._load_model, self.config.critic.model)[0]

    def values(self, model: torch.nn.Module, mb: TrainBatch) -> torch.Tensor:
        """``[B, T]``: position ``t`` holds the value of the state before token ``t``."""
        out_BT = forward.outputs(model, self._row(mb, images=False))[..., 0].float()
        return F.pad(out_BT[:, :-1], (1, 0))

    def _per_token(self, mb: TrainBatch, own: bool = False) -> torch.Tensor:
        return self.values(self.engine, mb)

    def _loss(self, mb: TrainBatch, denominator):
        if mb.returns is None or mb.old_values is None:
            raise ValueError(
                "the critic trains on batches with returns and old_values (algorithm.advantage=gae)"
            )
        keep = mb.response_mask.bool() & mb.tool_mask.bool()
        loss, metrics = value_loss(
            self.values(self.engine, mb),
            mb.old_values,
            mb.returns,
            keep,
            denominator,
            self.config.critic.value_clip,
            self.config.loss.aggregation,
            mb.sequence_tokens,
            self.config.aggregation_norm,
        )
        residual = mb.returns - mb.old_values
        for name, x in {"return_sq": mb.returns**2, "residual": residual, "residual_sq": residual**2}.items():
            metrics[name] = torch.where(keep, x.float(), 0.0).sum()
        metrics["question"] = question_sums(keep, mb.returns, residual, mb.counted)
        return loss, metrics

    def _finish_metrics(self, out: dict[str, float]) -> dict[str, float]:
        """Global token means; explained variance ``1 - Var(R - V) / Var(R)`` of the values at
        rollout time (positive once the critic predicts the returns better than their mean)."""
        p = self.PREFIX
        var_return = out.pop(f"{p}/return_sq") - out[f"{p}/return"] ** 2
        var_residual = out.pop(f"{p}/residual_sq") - out.pop(f"{p}/residual") ** 2
        out[f"{p}/explained_variance"] = (
            1.0 - var_residual / var_return if var_return > 1e-12 else float("nan")
        )
        out[f"{p}/return_variance"] = var_return  # what there is to explain (token-weighted)
        out[f"{p}/value_clip_fraction"] = out.pop(f"{p}/value_clipped")
        out[f"{p}/value_mean"] = out.pop(f"{p}/value")
        out[f"{p}/return_mean"] = out.pop(f"{p}/return")
        return out

    def _finish_totals(self, totals: dict[str, torch.Tensor], optimizer_steps: int) -> dict[str, float]:
        """``question_explained_variance``: what the critic makes of each question before a token is
        sampled, over the samples (comparable with what knowing each question's success rate would
        explain: ``benchmarks/critic_variance.py``'s prompt oracle)."""
        n, ret, ret_sq, res, res_sq = (float(x) for x in totals["question"])
        var_return = ret_sq / n - (ret / n) ** 2 if n else 0.0
        var_residual = res_sq / n - (res / n) ** 2 if n else 0.0
        explained = 1.0 - var_residual / var_return if var_return > 1e-12 else float("nan")
        return {f"{self.PREFIX}/question_explained_variance": explained}
