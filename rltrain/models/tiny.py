"""A tiny Qwen2 causal LM and a lossless byte-level tokenizer, built locally (no hub download).

Used by the CPU demo and the tests. The shape follows what vLLM's CPU backend supports: head_dim 32
(64 hidden / 2 heads), untied embeddings (tied ones break vLLM's in-place weight reload), and a
vocabulary exactly the tokenizer's size (larger would let vLLM sample ids the tokenizer lacks).
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5's tool tags are single tokens too, and not special: decoding keeps them, so a sampled
# call reads back as text the tool parser finds. (Byte by byte, one call round trip costs ~50 more
# tokens in every episode that uses the tool.)
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
HEAD_DIM = 32  # the smallest head size vLLM's CPU attention supports
DEFAULT_HIDDEN_SIZE = 64
MOE_EXPERTS, MOE_TOP_K = 8, 2  # of builtin:tiny-moe
TINY_WINDOW = (
    8  # the sliding window of builtin:tiny-gpt-oss and builtin:tiny-gemma3: shorter than most completions
)
TINY_ATTENTION_HEADS = DEFAULT_HIDDEN_SIZE // HEAD_DIM  # of the default built-in model
# Qwen2.5's structure, with a shorter tool preamble (every character is a token here): tools as
# one line each in the system turn, calls as JSON in <tool_call> tags, results as <tool_response>
# blocks in one user turn. Without tools it renders exactly what it did before tools came.
# (newlines right after a block tag are written as {{ '\n' }}: chat templates trim them)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\n' }}{% endif %}"
    "<tools>{% for tool in tools %}{{ '\n' + tool.function.name }}"
    "({{ tool.function.parameters.properties | join(', ') }}){% endfor %}{{ '\n' }}</tools><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first and tools %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{% set f = call.function or call %}"
    '<tool_call>{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}</tool_call>'
    "{% endfor %}<|im_end|>{{ '\n' }}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ message.role + '\n' + message.content }}<|im_end|>{{ '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}"
)


# builtin:tiny-vl (Qwen2.5-VL's): an image's place in a prompt, and the tokens the processor expands
# its placeholder to (one per 2 x 2 merged patches of 14 x 14 pixels)
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# its images: resized to whole merged patches of 28 x 28 pixels, between 2 x 2 and 8 x 8 of them
TINY_VL_PIXELS = {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}
# the chat template of builtin:tiny-vl: a user's, system's or tool's content may be a list of parts,
# an image part rendered as Qwen2.5-VL's placeholder (strings render as they do in CHAT_TEMPLATE)
_VL_CONTENT = (
    "{% if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message.content %}{% if part.type in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part.type == 'text' %}{{ part.text }}{% endif %}"
    "{% endfor %}{% endif %}"
)
VL_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ message.role + '\n' + message.content }}", "{{ message.role + '\n' }}" + _VL_CONTENT
).replace(
    "{{ '\n<tool_response>\n' + message.content + '\n</tool_response>' }}",
    "{{ '\n<tool_response>\n' }}" + _VL_CONTENT + "{{ '\n</tool_response>' }}",
)


def build_tokenizer(vision: bool = False):
    """Byte-level BPE with no merges: the 256 byte symbols, the chat special tokens and the tool tags
    (``vision``: and :data:`VISION_TOKENS`, with :data:`VL_CHAT_TEMPLATE`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(byte_symbols))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    if vision:
        tok.add_special_tokens(VISION_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=VL_CHAT_TEMPLATE if vision else CHAT_TEMPLATE,
        **(
            {"extra_special_tokens": {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}}
            if vision
            else {}
        ),
    )


def family_config(family: str, shape: dict, hidden_size: int):
    """The transformers config of a built-in tiny model of ``family`` (see :func:`build_tiny_model`).
    Each family's config class is imported alone: importing one loads its module and those it
    builds on (Gemma 3's loads SigLIP's, ~2 s of a run's start on 2 cores)."""
    import transformers

    if family == "qwen2_5_vl":  # a vision tower of one block; rotary positions on 3 axes
        return _vl_config(shape)
    config_class = getattr(transformers, {
        "qwen3_moe": "Qwen3MoeConfig", "gpt_oss": "GptOssConfig", "gemma3_text": "Gemma3TextConfig",
        "qwen3_5_text": "Qwen3_5TextConfig", "qwen2": "Qwen2Config", "llama": "LlamaConfig"}[family])  # fmt: skip
    if family == "qwen3_moe":  # vLLM's CPU experts need sizes divisible by 32
        config = config_class(**shape, head_dim=HEAD_DIM, num_experts=MOE_EXPERTS,
                                num_experts_per_tok=MOE_TOP_K, moe_intermediate_size=hidden_size,
                                norm_topk_prob=True)  # fmt: skip
    elif family == "gpt_oss":  # a window shorter than most completions, sinks, 4 experts
        config = config_class(**shape, head_dim=HEAD_DIM, sliding_window=TINY_WINDOW, num_local_experts=4,
                              num_experts_per_tok=MOE_TOP_K, layer_types=["sliding_attention", "full_attention"],
                              # gpt-oss's own YaRN positions, its context of 1,024 = 32 x 32
                              rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 32})  # fmt: skip
    elif family == "gemma3_text":  # sliding and full layers, the attention scale and the logit soft-cap
        config = config_class(**shape, head_dim=HEAD_DIM, sliding_window=TINY_WINDOW, query_pre_attn_scalar=HEAD_DIM,
                                  layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=30.0)  # fmt: skip
    elif (
        family == "qwen3_5_text"
    ):  # Gated DeltaNet (linear attention, a recurrent state) beside full attention
        config = config_class(**shape, head_dim=HEAD_DIM, linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM,
                                   linear_num_key_heads=1, linear_num_value_heads=2,
                                   layer_types=["linear_attention", "full_attention"])  # fmt: skip
    else:
        config = config_class(**shape)
    return config


def _vl_config(shape: dict):
    """builtin:tiny-vl: Qwen2.5-VL's text model in ``shape`` (its M-RoPE sections over the head's 16
    frequencies) and a vision tower of one full-attention block (head size 32, vLLM's CPU minimum)."""
    from transformers import Qwen2_5_VLConfig

    text = {k: v for k, v in shape.items() if k != "tie_word_embeddings"}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    vision = {"depth": 1, "hidden_size": HEAD_DIM, "num_heads": 1, "intermediate_size": 2 * HEAD_DIM,
              "out_hidden_size": shape["hidden_size"], "fullatt_block_indexes": [0]}  # fmt: skip
    tokenizer = build_tokenizer(vision=True)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           zip(["vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"], VISION_TOKENS)}  # fmt: skip
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                            torch_dtype="float32", **ids)  # fmt: skip


def _save_processor(out: Path, tokenizer) -> None:
    """builtin:tiny-vl's processor (its image processor at :data:`TINY_VL_PIXELS`), beside the model."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    images = Qwen2VLImageProcessor(size=TINY_VL_PIXELS)
    Qwen2_5_VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor(),
                        chat_template=VL_CHAT_TEMPLATE).save_pretrained(out)  # fmt: skip


def build_tiny_model(
    out_dir: str | Path,
    seed: int = 0,
    hidden_size: int = DEFAULT_HIDDEN_SIZE,
    num_layers: int = 2,
    tie_word_embeddings: bool = False,
    family: str = "qwen2",
    router_std: float | None = None,
) -> Path:
    """Write a freshly initialized tiny model and its tokenizer to ``out_dir``; returns the folder.
    ``tie_word_embeddings``: the output head shares the input embeddings, as most pretrained
    checkpoints' do (Qwen2.5, Llama 3.2, SmolLM2, Gemma). ``family``: ``qwen2``, ``llama`` (the
    architecture engines build for it; vLLM's Llama, for one, takes LoRA on its output head) or
    ``qwen3_moe`` (:data:`MOE_EXPERTS` experts per layer, top-:data:`MOE_TOP_K`: ``builtin:tiny-moe``),
    ``gpt_oss`` (``builtin:tiny-gpt-oss``) or ``gemma3_text`` (``builtin:tiny-gemma3``), each with a
    window of :data:`TINY_WINDOW`, or ``qwen3_5_text`` (``builtin:tiny-qwen3.5``: a Gated DeltaNet
    layer and a full-attention one).
    ``router_std``: the routers' initial scale (an MoE's default, 0.02, sits near ties: every expert
    about equally likely; ~0.5 routes decisively)."""
    import torch
    from transformers.utils import logging as hf_logging

    from rltrain.models.families import causal_lm_class

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    tokenizer = build_tokenizer(vision=family == "qwen2_5_vl")
    shape = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // HEAD_DIM,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    config = family_config(family, shape, hidden_size)
    torch.manual_seed(seed)
    model = causal_lm_class(config).from_config(config)
    if router_std is not None:
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                torch.nn.init.normal_(param, std=router_std)
    out.mkdir(parents=True, exist_ok=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-shard save needs no progress bar on the console
    try:
        model.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if family == "qwen2_5_vl":
        _save_processor(out, tokenizer)
    tokenizer.save_pretrained(out)  # written last: its presence marks a complete folder
    return out
