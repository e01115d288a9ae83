"""Models that score and never train, on the learners' engine path: the teacher of on-policy
distillation (per-token log-probs, computed exactly as the reference model's) and a reward model
(one score per sequence). Each runs as a :class:`~rltrain.learner.group.LearnerGroup` of its own
actors (``algorithm.teacher_learners``, ``reward.model_learners``): batches are planned over them
like a critic's, padded or packed, and every actor scores its share at the same time.

A frozen actor has no optimizer and no gradients. At ZeRO stage 0 it holds the whole model; at
stage 3 DeepSpeed shards its weights over the group (a model larger than one device).
"""

from __future__ import annotations

import torch

from rltrain import forward
from rltrain.batch import TrainBatch, last_positions
from rltrain.config import Config, FrozenLearnerConfig
from rltrain.forward.head import output_head
from rltrain.learner.engine import EngineLearner
from rltrain.learner.policy import PolicyLearner
from rltrain.learner.start import load_scalar_head


class FrozenLearner(EngineLearner):
    """An :class:`EngineLearner` that only runs :meth:`per_token`."""

    trains_adapters = False
    trains_tower = False

    def _start_engine(self, total_optimizer_steps: int) -> None:
        import deepspeed

        model = self._build_model().eval().requires_grad_(False)
        if self.lc.zero_stage == 3:  # weights sharded over the group, gathered layer by layer
            ds_config = {
                "train_micro_batch_size_per_gpu": self.lc.micro_batch_size,
                "zero_optimization": {"stage": 3},
                "bf16": {"enabled": self.bf16},
                "steps_per_print": 10**9,
            }
            self.engine, *_ = deepspeed.initialize(model=model, config=ds_config)
            self.engine.eval()
        else:
            self.engine = model.to("cuda" if self.use_cuda else "cpu")
        output_head(self.engine)  # (a language model's head path, checked once on a probe)

    def train_step(self, groups: list[list[TrainBatch]], counted=None) -> dict[str, float]:
        raise RuntimeError(f"a {self.ROLE} scores and never trains")

    def _shared_forwards(self) -> dict:
        return {self.ROLE: self._per_token}


class TeacherLearner(FrozenLearner, PolicyLearner):
    """``algorithm.teacher``: its log-prob of every token given the prefix, at the sampling
    temperature, through the policy's own log-prob path (padded or packed)."""

    ROLE = "teacher"
    KEY = "algorithm.teacher_learners"

    @staticmethod
    def section(config: Config) -> FrozenLearnerConfig:
        return config.algorithm.teacher_learners

    def _build_model(self) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        return self._load_model(AutoModelForCausalLM, self.config.algorithm.teacher)

    def _scored_path(self) -> str:
        return self.config.algorithm.teacher

    def _per_token(self, mb: TrainBatch, own: bool = False) -> torch.Tensor:
        return self._logprobs(self.engine, mb)[0]


class RewardModelLearner(FrozenLearner):
    """``reward.model``: a sequence-classification model with one label. Its score head is run on
    every position (loaded as token classification: Llama, Qwen and Mistral name the head ``score``
    in both), so packed rows work; a sequence's score is the output at its last token, which is
    what sequence classification pools."""

    ROLE = "reward model"
    KEY = "reward.model_learners"

    @staticmethod
    def section(config: Config) -> FrozenLearnerConfig:
        return config.reward.model_learners

    def _build_model(self) -> torch.nn.Module:
        model, missing = load_scalar_head(self._load_model, self.config.reward.model)
        # the token classifier's head has a bias where the sequence classifier's has none: it is 0
        untrained = {n for n in missing if not (n.endswith(".bias") and n[:-5] + ".weight" not in missing)}
        if untrained:
            raise ValueError(
                f"reward.model: {self.config.reward.model} has no trained score head "
                f"(missing: {', '.join(sorted(untrained)[:3])})"
            )
        return model

    def _per_token(self, mb: TrainBatch, own: bool = False) -> torch.Tensor:
        """``[B, T]``: the score head at every position; :func:`last_token_scores` picks the score."""
        return forward.outputs(self.engine, self._row(mb, images=False))[..., 0].float()

    def _compared_positions(self, mb: TrainBatch) -> torch.Tensor:
        """Each sequence's score: its last token."""
        keep = torch.zeros_like(mb.attention_mask, dtype=torch.bool)
        if mb.blank is None:
            keep.scatter_(-1, last_positions(mb.attention_mask)[:, None], True)
        return keep & mb.attention_mask.bool()


def last_token_scores(outputs_BT: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's output at its last attended token (right-padded rows)."""
    return outputs_BT.gather(-1, last_positions(attention_mask_BT)[:, None]).squeeze(-1)
