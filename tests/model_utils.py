"""Helpers for tests that compare models: a nudged copy of one; remote code that ignores position ids."""

from __future__ import annotations

import json
from pathlib import Path

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


POSITIONLESS = '''"""A causal LM that ignores the position ids it is given (its positions count along the row),
as remote code written for padded batches may: a prefix tree's branches then see their siblings."""

from transformers import Qwen2Config, Qwen2ForCausalLM


class PositionlessConfig(Qwen2Config):
    model_type = "positionless"


class PositionlessForCausalLM(Qwen2ForCausalLM):
    config_class = PositionlessConfig

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        return super().forward(input_ids=input_ids, **kwargs)
'''


def positionless_model(model_path, out) -> str:
    """The model at ``model_path`` as remote code that ignores position ids
    (``model.trust_remote_code``): its tree rows differ from its unshared ones."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_path).iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "modeling_positionless.py").write_text(POSITIONLESS)
    config = json.loads((out / "config.json").read_text())
    config |= {"model_type": "positionless", "architectures": ["PositionlessForCausalLM"], "auto_map": {
        "AutoConfig": "modeling_positionless.PositionlessConfig",
        "AutoModelForCausalLM": "modeling_positionless.PositionlessForCausalLM",
    }}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return str(out)
