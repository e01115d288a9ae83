"""The warm start's learner: a policy learner whose loss is the cross-entropy of the completion
tokens (tool output masked out), reduced with the same ``masked_mean`` denominators as the RL loss,
so it is exact in ``token`` mode under any layout (the warm start itself: :mod:`rltrain.run.warm_start`).
"""

from __future__ import annotations

import torch

from rltrain.batch import TrainBatch
from rltrain.config import Config, LearnerConfig
from rltrain.learner.policy import PolicyLearner
from rltrain.loss.masked_mean import aggregate


class SFTLearner(PolicyLearner):
    ROLE = "sft learner"
    PREFIX = "sft"
    PERF = "sft_"
    METRIC_SUMS = ["loss", "tokens"]
    TEMPERATURE = 1.0  # the model's own distribution, not the sampling temperature

    @staticmethod
    def section(config: Config) -> LearnerConfig:
        """The policy's layout with the warm-up's optimizer settings (one step per batch)."""
        sft = config.sft_warmup
        return config.learner.model_copy(
            update={
                "lr": sft.lr,
                "lr_schedule": sft.lr_schedule,
                "warmup_steps": 0,
                "num_mini_batches": 1,
                "ppo_epochs": 1,
            }
        )

    has_reference = False  # the warm start has no KL

    @property
    def lora_rank(self) -> int:
        """The adapters' rank where the warm start trains adapters (``sft_warmup.lora``), else 0."""
        return self.config.model.lora.rank if self.config.sft_warmup.lora else 0

    def _build_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        if self.lora_rank:  # the warm start trains adapters as RL does (exported merged)
            return super()._build_model()
        return self._load_model(AutoModelForCausalLM)  # no reference: the warm start has no KL

    def _before_training(self, groups: list[list[TrainBatch]]) -> list[list[TrainBatch]]:
        return groups

    def zero_gradient_proof(self) -> str | None:
        return "the warm start's own loss (the cross-entropy of every completion token)"

    def _finish_metrics(self, out: dict[str, float]) -> dict[str, float]:
        return out

    def _loss(self, mb: TrainBatch, denominator):
        logprobs, _ = self._logprobs(self.engine, mb)
        mask = mb.response_mask * mb.tool_mask
        loss = aggregate(-logprobs, mask, self.config.loss.aggregation, denominator, mb.sequence_tokens,
                         self.config.aggregation_norm)  # fmt: skip
        return loss, {"loss": -(logprobs.detach() * mask).sum(), "tokens": mask.sum()}
