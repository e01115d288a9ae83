"""What passes between stages, and how a global batch is laid out over ranks and micro-batches.

Pure torch: no ray, no deepspeed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch


@dataclass
class TrainBatch:
    """Scored rollouts ready for the learners. Every ``[N, T]`` tensor is aligned with ``input_ids``.

    ``response_mask`` is 1 on completion tokens (0 on prompt and padding); ``tool_mask`` is 0 on
    tokens a tool inserted. Loss tokens are ``response_mask & tool_mask``. Log-prob tensors hold at
    position ``t`` the log-prob of ``input_ids[:, t]`` given its prefix.
    """

    input_ids: torch.Tensor  # [N, T]
    attention_mask: torch.Tensor  # [N, T]
    response_mask: torch.Tensor  # [N, T]
    tool_mask: torch.Tensor  # [N, T]
    advantages: torch.Tensor  # [N]
    generator_logprobs: torch.Tensor | None = None  # [N, T]
    old_logprobs: torch.Tensor | None = None  # [N, T]
    ref_logprobs: torch.Tensor | None = None  # [N, T]

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def select(self, idx: torch.Tensor) -> TrainBatch:
        return TrainBatch(**{f.name: _take(getattr(self, f.name), idx) for f in fields(self)})

    def replace(self, **changes: torch.Tensor | None) -> TrainBatch:
        return TrainBatch(**{f.name: changes.get(f.name, getattr(self, f.name)) for f in fields(self)})

    def validate(self) -> None:
        """Shape and value checks with messages that say what is wrong (called before training)."""
        n, t = self.input_ids.shape
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            want = (n,) if f.name == "advantages" else (n, t)
            if tuple(value.shape) != want:
                raise ValueError(f"TrainBatch.{f.name} has shape {tuple(value.shape)}, expected {want}")
            if value.is_floating_point() and not torch.isfinite(value).all():
                raise ValueError(f"TrainBatch.{f.name} holds NaN or inf")
        if (self.response_mask.bool() & ~self.attention_mask.bool()).any():
            raise ValueError("TrainBatch.response_mask marks tokens that attention_mask excludes")

    @staticmethod
    def concat(batches: list[TrainBatch]) -> TrainBatch:
        def cat(name: str):
            values = [getattr(b, name) for b in batches]
            return None if any(v is None for v in values) else torch.cat(values)

        return TrainBatch(**{f.name: cat(f.name) for f in fields(TrainBatch)})


def _take(value: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if value is None else value[idx]


@dataclass
class MicroBatchPlan:
    """Sequence indices of every micro-batch, per rank and per accumulation group.

    ``groups[r][g][m]`` is a (possibly empty) index tensor: rank ``r``'s micro-batch ``m`` of
    accumulation group ``g``. Every rank has the same number of groups, and every group the same
    number of micro-batches (``accumulation_steps``), so collectives (ZeRO-3 gathers, the
    token-total all-reduce) stay in lockstep; shorter shares are padded with empty micro-batches
    that contribute zero.
    """

    groups: list[list[list[torch.Tensor]]] = field(default_factory=list)

    @property
    def accumulation_steps(self) -> int:
        return len(self.groups[0][0])

    def all_indices(self) -> torch.Tensor:
        return torch.cat([idx for rank in self.groups for group in rank for idx in group])


def plan_micro_batches(
    num_sequences: int, world_size: int, num_mini_batches: int, micro_batch_size: int
) -> MicroBatchPlan:
    """Cut ``num_sequences`` into accumulation groups, ranks and micro-batches; drop nothing.

    Groups are contiguous and as even as possible (sizes differ by at most one); within a group,
    ranks get contiguous shares as even as possible; each share is cut into micro-batches of at most
    ``micro_batch_size``, and shorter shares are padded with empty micro-batches.
    """
    if num_sequences < num_mini_batches:
        raise ValueError(f"{num_sequences} sequences cannot fill {num_mini_batches} mini-batches")
    groups = torch.arange(num_sequences).tensor_split(num_mini_batches)
    largest_share = -(-max(len(g) for g in groups) // world_size)  # ceil
    accumulation_steps = max(1, -(-largest_share // micro_batch_size))
    plan: list[list[list[torch.Tensor]]] = [[] for _ in range(world_size)]
    for group in groups:
        for rank, share in enumerate(group.tensor_split(world_size)):
            micro = list(share.split(micro_batch_size)) if len(share) else []
            micro += [share[:0]] * (accumulation_steps - len(micro))
            plan[rank].append(micro)
    return MicroBatchPlan(plan)
