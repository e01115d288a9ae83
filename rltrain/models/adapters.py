"""LoRA adapters (``model.lora``), shared by the learners that train them and the engines that
sample with them (no ray, no vllm): the peft config, an adapter's tensors by peft's file names, its
folder on disk, and the merge into the base model's weights.

An adapter's tensors are named as peft writes them to ``adapter_model.safetensors``
(``base_model.model.<module>.lora_A.weight``), so one dict is what the learners send, what an
engine loads (vLLM from the folder, transformers through peft) and what ``final_adapter/`` holds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

ADAPTER_NAME = "default"  # peft's name of the one adapter a learner trains
PEFT_PREFIX = "base_model.model."
# the ranks vLLM's LoRA kernels are built for; an engine takes the smallest one that holds the adapter
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def peft_config(lora):
    """peft's ``LoraConfig`` for the ``model.lora`` section."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )


def wrap(model: torch.nn.Module, lora) -> torch.nn.Module:
    """``model`` with fresh adapters on ``lora.target_modules`` (B = 0: the same function as the
    base); only the adapters' parameters require gradients."""
    from peft import get_peft_model

    return get_peft_model(model, peft_config(lora))


def file_name(parameter_name: str) -> str:
    """peft's file name of an adapter parameter (its adapter name dropped): ``...lora_A.default.weight``
    is ``...lora_A.weight``."""
    return parameter_name.replace(f".{ADAPTER_NAME}.", ".")


def is_adapter(parameter_name: str) -> bool:
    return ".lora_A." in parameter_name or ".lora_B." in parameter_name


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], lora, base_model: str = "") -> Path:
    """A peft adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) that vLLM's
    ``LoRARequest`` and ``PeftModel.from_pretrained`` load."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config: dict[str, Any] = peft_config(lora).to_dict()
    config["base_model_name_or_path"] = base_model
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, default=str))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "adapter_model.safetensors"))
    return folder


def vllm_max_rank(rank: int) -> int:
    return next(r for r in VLLM_RANKS if r >= rank)


def merged(state: dict[str, torch.Tensor], lora) -> dict[str, torch.Tensor]:
    """A peft model's named weights (adapter names included) as the base model's, each adapted
    weight merged: ``W + alpha / r * B @ A``; the adapters themselves dropped."""
    scale = lora.alpha / lora.rank
    out = {}
    for name, value in state.items():
        if is_adapter(name):
            continue
        base = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        match = re.fullmatch(r"(.*)\.base_layer\.weight", name)
        if match is not None:
            a = state[f"{match.group(1)}.lora_A.{ADAPTER_NAME}.weight"]
            b = state[f"{match.group(1)}.lora_B.{ADAPTER_NAME}.weight"]
            value = value + scale * (b.float() @ a.float()).to(value.dtype)
        out[base] = value
    return out


# where a linear layer sits, read from its module path: attention or MLP (experts and shared
# experts included); a router's own projection (``gate``, ``router``) is neither
ATTENTION_PARTS = ("attn", "attention", "mixer", "mamba")
MLP_PARTS = ("mlp", "ffn", "feed_forward", "moe", "experts", "expert")
ROUTERS = ("gate", "router", "router_logits")


def _inside(parts: list[str], names: tuple[str, ...], endings: tuple[str, ...]) -> bool:
    """Whether a module path's parts (its leaf left out) pass through a module named one of
    ``names`` or ending in one of ``endings``."""
    return any(p in names or p.endswith(endings) for p in parts)


def lora_targets(model: torch.nn.Module, attention: bool, mlp: bool, unembed: bool) -> list[str]:
    """The ``target_modules`` that put adapters on every linear layer of ``model``'s attention
    (``attention``), of its MLP (``mlp``) and on its output head (``unembed``), by the names this
    family gives them (fused projections included: ``qkv_proj``, ``c_attn``, ``query_key_value``):
    each layer's own name where it names layers of one kind only, else its parent's name with it
    (``attn.c_proj`` and ``mlp.c_proj``). A model on the meta device is enough."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kinds: dict[str, set[str]] = {}  # a linear layer's path -> its kind
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear | Conv1D):
            continue
        parts = path.split(".")
        if module is head:
            kinds[path] = {"unembed"}
        elif parts[-1] in ROUTERS or parts[-1].endswith(("_gate", "_router")):  # (a shared expert's gate too)
            continue
        elif _inside(parts[:-1], ATTENTION_PARTS, ("attn", "attention")):
            kinds[path] = {"attention"}
        elif _inside(parts[:-1], MLP_PARTS, MLP_PARTS):
            kinds[path] = {"mlp"}
    wanted = {k for k, on in (("attention", attention), ("mlp", mlp), ("unembed", unembed)) if on}
    by_leaf: dict[str, set[str]] = {}
    for path, kind in kinds.items():
        by_leaf.setdefault(path.rpartition(".")[2], set()).update(kind)
    targets: list[str] = []
    for path, kind in kinds.items():
        if not kind & wanted:
            continue
        leaf = path.rpartition(".")[2]
        name = leaf if by_leaf[leaf] <= wanted else ".".join(path.split(".")[-2:])
        if name not in targets:
            targets.append(name)
    return targets


def fused_experts(model: torch.nn.Module) -> list[str]:
    """The MLP parameters of ``model`` that hold every expert at once (``[E, ...]`` tensors, not
    linear layers): LoRA on linear layers does not reach them."""
    out = []
    for path, parameter in model.named_parameters():
        if parameter.dim() >= 3 and _inside(path.split(".")[:-1], MLP_PARTS, MLP_PARTS):
            out.append(path)
    return out
