"""What a model object is under its wrappers: the transformers model inside a DeepSpeed engine or a
peft model, its config, and whether its rotary positions have several axes."""

from __future__ import annotations

import torch


def model_config(model: torch.nn.Module):
    """The config of a causal LM, also inside a DeepSpeed engine or a peft model."""
    return getattr(causal_lm(model), "config", None)


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model itself, also inside a DeepSpeed engine or a peft model."""
    lm = getattr(model, "module", model)  # a DeepSpeed engine's model
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # a peft model's


def multi_axis_positions(model_or_config) -> bool:
    """Whether the model's rotary positions have several axes (Qwen2-VL's M-RoPE: time, height and
    width; a text token's three are its position): its forward then takes ``[4, B, L]`` position
    ids, the text positions that tell documents apart first, as its own ``get_rope_index`` builds
    them for a packed batch."""
    config = (
        model_or_config if not isinstance(model_or_config, torch.nn.Module) else model_config(model_or_config)
    )
    for c in (config, getattr(config, "text_config", None)):
        for name in ("rope_parameters", "rope_scaling"):
            rope = getattr(c, name, None)
            if isinstance(rope, dict) and "mrope_section" in rope:
                return True
    return False
