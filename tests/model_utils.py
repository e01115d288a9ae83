"""Helpers for tests that compare a model with a slightly changed copy of itself."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def nudged(path, scale: float, seed: int = 0, suffix: str = ""):
    """The model at ``path`` with Gaussian noise of standard deviation ``scale`` added to every
    weight whose name ends with ``suffix`` (all of them by default)."""
    model = AutoModelForCausalLM.from_pretrained(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(suffix):
                param.add_(scale * torch.randn(param.shape, generator=g))
    return model
