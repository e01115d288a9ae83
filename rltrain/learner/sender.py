"""The learners' side of the weight sync: which tensors go to the engines, by which names, and the
collective sync's sender (:mod:`rltrain.weight_transfer`).

What travels is the model's whole state as its checkpoint holds it: every parameter and every
persistent buffer (the score-correction biases of DeepSeek-V3's, GLM-4.5's, MiniMax-M2's and
LFM2-MoE's routers steer which experts a token goes to; a sync of ``named_parameters()`` alone
left them behind, and an engine that had not loaded them from the same files computed another
network). Buffers are not partitioned by ZeRO-3: every rank holds them whole."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from rltrain import weight_transfer
from rltrain.models import adapters
from rltrain.models.images import is_vision_parameter


class WeightSender:
    """Mixed into :class:`~rltrain.learner.state.LearnerState` (which sets ``engine``, ``lc``,
    ``config``, ``rank`` and ``sent_bytes``)."""

    def _sent(self, keep: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor, str | None]]:
        """The parameters and persistent buffers that ``keep`` names, by every name the model's own
        state dict has, each with the name it was first seen under where it is shared (a tied output
        head: ``named_parameters()`` names it once, and an engine that reloads in place kept its
        first head), else None."""
        first_name: dict[int, str] = {}
        for name, tensor in weight_transfer.state_tensors(self.engine.module):
            if keep(name):
                yield name, tensor, first_name.get(id(tensor))
                first_name.setdefault(id(tensor), name)

    def _sent_names(
        self, adapters_only: bool, synced: bool = True
    ) -> tuple[Callable[[str], bool], Callable[[str], str]]:
        """Which parameters a sync sends and the name each goes by: every one by its own name (a
        sync leaves a frozen vision side out: ``model.freeze_vision``; ``synced`` false keeps it,
        as an export does), or the LoRA adapters by peft's file names."""
        if adapters_only:
            return adapters.is_adapter, adapters.file_name
        if synced and self.config.model.freeze_vision:
            return (lambda name: not is_vision_parameter(name)), (lambda name: name)
        return (lambda name: True), (lambda name: name)

    def weight_layout(
        self, adapters_only: bool, bucket_bytes: int, synced: bool = True
    ) -> weight_transfer.Layout:
        """What a collective sync sends (rank 0): the tensors, their buckets and the shared names;
        ``synced`` false: every parameter (an export's)."""
        keep, rename = self._sent_names(adapters_only, synced)
        metas, aliases = [], {}
        for name, param, shared in self._sent(keep):
            if shared is not None:
                aliases[rename(name)] = rename(shared)
            else:  # under ZeRO-3 a rank holds a shard; ds_shape is the whole parameter's
                shape = tuple(getattr(param, "ds_shape", param.shape))
                metas.append(weight_transfer.TensorMeta(rename(name), shape, param.dtype))
        return weight_transfer.plan_buckets(metas, bucket_bytes, aliases)

    def device_key(self) -> str | None:
        return weight_transfer.device_key()

    def shared_memory_free(self) -> int:
        return weight_transfer.shared_memory_free()

    def open_weight_group(
        self, address: str, port: int, world_size: int, backend: str, timeout_s: float
    ) -> None:
        """Rank 0 joins the weight group as its sender (and hosts its store)."""
        self.weight_group = weight_transfer.open_group(address, port, 0, world_size, backend, timeout_s)

    def broadcast_weights(self, adapters_only: bool, layout: weight_transfer.Layout) -> None:
        """A collective sync: every rank gathers each bucket's parameters at once (ZeRO-3: one
        all-gather a bucket), rank 0 sends it."""
        tensors = self._bucketed(adapters_only, layout)
        if self.rank == 0:
            self.sent_bytes = weight_transfer.send(self.weight_group, layout, tensors)
        else:
            for _ in tensors:  # take part in every gather
                pass

    def _bucketed(
        self, adapters_only: bool, layout: weight_transfer.Layout
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Each tensor of ``layout``: every rank gathers a bucket's parameters at once under ZeRO-3
        (every rank must iterate together); on rank 0 a view valid until the bucket's last item
        (None elsewhere)."""
        import deepspeed

        keep, rename = self._sent_names(adapters_only, synced=False)  # (the layout picks)
        params = {rename(name): param for name, param, shared in self._sent(keep) if shared is None}
        for bucket in layout.buckets:
            group = [params[meta.name] for meta in bucket]
            with deepspeed.zero.GatheredParameters(group, enabled=self.lc.zero_stage == 3):
                for meta, param in zip(bucket, group):
                    yield meta.name, param.detach() if self.rank == 0 else None
