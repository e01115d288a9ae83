"""A vLLM engine's LoRA adapters: the policy's, one folder per version as a training run syncs
them, and adapters held side by side (the Tinker server's sampling clients), each request naming
its own; and the engine options that serve them."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from rltrain.config import RolloutConfig
from rltrain.models import adapters


class AdapterFolders:
    """A vLLM engine's LoRA adapters on local disk, one folder per version, as many as it keeps
    loaded (``max_loras``): the newest, and the older ones rollouts in flight may still use."""

    def __init__(self, lora, slots: int):
        import tempfile
        import weakref

        self.lora, self.slots = lora, slots
        self.root = Path(tempfile.mkdtemp(prefix="rltrain-adapters-"))
        weakref.finalize(self, shutil.rmtree, self.root, True)  # (at the engine's end, or its process's)
        self.loaded: list[Any] = []  # LoRARequests, oldest first
        self.count = 0
        self.held: dict[int, Any] = {}  # adapters served side by side (hold): LoRARequests

    @property
    def request(self):
        return self.loaded[-1] if self.loaded else None

    def hold(self, adapter: int, tensors: dict[str, torch.Tensor]) -> None:
        """Adapters served beside the policy's and each other (:meth:`VLLMBackend.hold_adapter
        <rltrain.rollout.backends.VLLMBackend.hold_adapter>`), under ids past the policy's own."""
        from vllm.lora.request import LoRARequest

        folder = adapters.write_adapter(self.root / f"held_{adapter}", tensors, self.lora)
        self.held[adapter] = LoRARequest(f"held-{adapter}", HELD_ADAPTERS + adapter, str(folder))

    def drop(self, adapter: int) -> int:
        """A held adapter's folder removed; its vLLM id, for the engine to let go of."""
        request = self.held.pop(adapter)
        shutil.rmtree(request.lora_path, ignore_errors=True)
        return request.lora_int_id

    def add(self, tensors: dict[str, torch.Tensor]) -> list[Any]:
        """Write the adapter and make it the newest; returns the requests dropped (their folders removed)."""
        from vllm.lora.request import LoRARequest

        self.count += 1  # vLLM's adapter ids start at 1
        folder = adapters.write_adapter(self.root / f"adapter_{self.count}", tensors, self.lora)
        self.loaded.append(LoRARequest(f"policy-{self.count}", self.count, str(folder)))
        dropped, self.loaded = self.loaded[: -self.slots], self.loaded[-self.slots :]
        for request in dropped:
            shutil.rmtree(request.lora_path, ignore_errors=True)
        return dropped


# held adapters' vLLM ids start past those of the policy's own versions
HELD_ADAPTERS = 1_000_000


def lora_slots(rc: RolloutConfig) -> int:
    """Adapters an engine keeps loaded: the newest and one per version rollouts in flight may use
    (``rollout.max_staleness``, and one more with in-flight updates)."""
    return rc.max_staleness + 2


def lora_options(lora, rc: RolloutConfig) -> dict[str, Any]:
    if lora is None:
        return {}
    slots = lora_slots(rc)
    # only the modules the adapters target get vLLM's LoRA layers: left open, a tied output head
    # would get one too, and its logits path fails on prompt log-probs (the sync check's)
    return {"enable_lora": True, "max_lora_rank": adapters.vllm_max_rank(lora.rank),
            "max_loras": slots, "max_cpu_loras": slots,
            "lora_target_modules": list(lora.target_modules)}  # fmt: skip
