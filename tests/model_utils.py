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


POSITIONLESS = '''"""A causal LM that reads a row's position ids as documents alone, as remote code written for
packed batches may: positions count along the row and restart where one is 0. Packed rows run as they
should; a prefix tree's branches, whose positions continue their prompt's, then see their siblings."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


class PositionlessConfig(Qwen2Config):
    model_type = "positionless"


class PositionlessForCausalLM(Qwen2ForCausalLM):
    config_class = PositionlessConfig

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        if position_ids is not None and kwargs.get("attention_mask") is None:  # a row of documents
            along = torch.arange(position_ids.shape[-1], device=position_ids.device).expand_as(position_ids)
            starts = torch.where(position_ids == 0, along, torch.zeros_like(along)).cummax(-1).values
            position_ids = along - starts
        return super().forward(input_ids=input_ids, position_ids=position_ids, **kwargs)
'''


IGNORES_POSITIONS = POSITIONLESS.replace(
    "        if position_ids is not None",
    "        position_ids = None  # (ignored)\n        if position_ids is not None",
)


def positionless_model(model_path, out, ignored: bool = False) -> str:
    """The model at ``model_path`` as remote code that reads position ids as documents alone
    (``model.trust_remote_code``): its tree rows differ from its unshared ones, packed or padded;
    ``ignored``: one that ignores them (its positions count along the row): its packed rows differ
    from its padded ones too."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_path).iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "modeling_positionless.py").write_text(IGNORES_POSITIONS if ignored else POSITIONLESS)
    config = json.loads((out / "config.json").read_text())
    config |= {"model_type": "positionless", "architectures": ["PositionlessForCausalLM"], "auto_map": {
        "AutoConfig": "modeling_positionless.PositionlessConfig",
        "AutoModelForCausalLM": "modeling_positionless.PositionlessForCausalLM",
    }}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def vision_model_without_grids(kind: str, out) -> str:
    """A tiny vision-language model whose processor gives no patch grids and whose rotary positions
    have one axis, with the built-in tokenizer and the vision chat template: ``llava`` (a CLIP tower)
    or ``gemma3`` (a SigLIP tower, Gemma 3's processor)."""
    import transformers as t

    from rltrain.models.tiny import VL_CHAT_TEMPLATE, build_tokenizer

    tokenizer = build_tokenizer(vision=True)
    image_token = tokenizer.convert_tokens_to_ids(tokenizer.image_token)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                 patch_size=14)  # fmt: skip
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    if kind == "llava":
        config = t.LlavaConfig(vision_config=t.CLIPVisionConfig(**tower), text_config=t.LlamaConfig(**text),
                               image_token_id=image_token, image_seq_length=4)  # fmt: skip
        model = t.LlavaForConditionalGeneration(config)
        processor = t.LlavaProcessor(
            image_processor=t.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}),
            tokenizer=tokenizer, patch_size=14, vision_feature_select_strategy="default",
            chat_template=VL_CHAT_TEMPLATE, image_token=tokenizer.image_token, num_additional_image_tokens=1,
        )  # fmt: skip
    else:
        tokenizer = t.PreTrainedTokenizerFast(
            tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
            padding_side="left", chat_template=VL_CHAT_TEMPLATE,
            extra_special_tokens={"image_token": "<|image_pad|>", "boi_token": "<|vision_start|>",
                                  "eoi_token": "<|vision_end|>"},
        )  # fmt: skip
        config = t.Gemma3Config(
            vision_config=t.SiglipVisionConfig(**tower), text_config=t.Gemma3TextConfig(**text, head_dim=32),
            image_token_id=image_token, mm_tokens_per_image=4,
            boi_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            eoi_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        )  # fmt: skip
        model = t.Gemma3ForConditionalGeneration(config)
        processor = t.Gemma3Processor(image_processor=t.Gemma3ImageProcessor(size={"height": 28, "width": 28}),
                                      tokenizer=tokenizer, chat_template=VL_CHAT_TEMPLATE, image_seq_length=4)  # fmt: skip
    model.save_pretrained(out)
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)
