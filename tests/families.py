"""Tiny models of the families people train, made from transformers configs (fp32, no download), and
the comparison every layout is held to: each sequence alone under the model's own ``eager``
attention. Shared by tests/test_families.py and the hybrid-layer tests."""

from __future__ import annotations

import contextlib
import types

import torch

from rltrain.batch import TrainBatch
from rltrain.forward import attention, sequence_logprobs
from rltrain.forward.tree import build_tree, tree_logprobs
from rltrain.models.families import attention_interface, causal_lm_class, needs, prepare

VOCAB = 128
# small shapes every family accepts: 2 layers (3 where a family mixes kinds), 4 query heads and 2
# key/value heads of 16, windows shorter than the completions
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)  # fmt: skip
WINDOW = 6  # tokens a sliding layer sees (itself included): the prompt alone is 14


def config(family: str, **changes):
    """The tiny config of ``family`` (a key of :data:`FAMILIES`, or a model type of :data:`MOE`),
    ``changes`` made to it."""
    import transformers as t

    if family in MOE:
        return moe_config(family, **changes)
    make, extra = FAMILIES[family]
    extra = {**extra, **changes}
    cls = getattr(t, make)
    shape = dict(SHAPE)
    if family == "qwen2.5-vl":  # its text model's config sits inside
        text = dict(
            shape, num_hidden_layers=2, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]}
        )
        text.pop("tie_word_embeddings")
        return cls(text_config=text, vision_config={"depth": 1, "hidden_size": 32, "out_hidden_size": 64,
                                                     "num_heads": 2, "intermediate_size": 32},
                   tie_word_embeddings=False, **extra)  # fmt: skip
    return cls(**{**shape, **extra})


FAMILIES = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2)),
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2)),
    "qwen2-sliding": (
        "Qwen2Config",
        dict(num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
    ),
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=2)),
    "mistral": ("MistralConfig", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "gemma2": (
        "Gemma2Config",
        dict(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=0.02,
            final_logit_softcapping=0.1,
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=0.1,
        ),
    ),
    "gemma4": (
        "Gemma4TextConfig",
        dict(
            num_hidden_layers=3,
            sliding_window=WINDOW,
            final_logit_softcapping=0.1,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            global_head_dim=16,
        ),
    ),
    "gpt-oss": (
        "GptOssConfig",
        dict(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "olmo3": (
        "Olmo3Config",
        dict(
            num_hidden_layers=3,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    "glm4": ("Glm4Config", dict(num_hidden_layers=2, partial_rotary_factor=0.5)),
    "falcon-h1": (
        "FalconH1Config",
        dict(
            num_hidden_layers=2,
            lm_head_multiplier=0.5,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            mamba_d_state=8,
            mamba_chunk_size=8,
            mamba_expand=1,
        ),
    ),
    "qwen2.5-vl": ("Qwen2_5_VLConfig", dict()),
    # families outside the first matrix: attention without position ids (Ministral 3, Granite 4.0's
    # hybrid), ALiBi and attention of its own (Bloom), state in code of its own (RecurrentGemma's
    # RG-LRU), a short convolution (LFM2), Mamba-1 (Jamba), Kimi's delta attention
    "ministral3": ("Ministral3Config", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    "granite4-hybrid": (
        "GraniteMoeHybridConfig",
        dict(
            num_hidden_layers=2,
            layer_types=["mamba", "attention"],
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_expand=1,
            mamba_d_state=8,
            mamba_n_groups=1,
            mamba_chunk_size=8,
            num_local_experts=0,
            shared_intermediate_size=96,
        ),
    ),  # fmt: skip
    "recurrentgemma": (
        "RecurrentGemmaConfig",
        dict(
            num_hidden_layers=3,
            block_types=["recurrent", "attention", "recurrent"],
            lru_width=64,
            attention_window_size=WINDOW,
            conv1d_width=4,
            logits_soft_cap=30.0,
            partial_rotary_factor=0.5,
        ),
    ),  # fmt: skip
    "bloom": ("BloomConfig", dict(n_layer=2, n_head=4)),
    "lfm2": (
        "Lfm2Config",
        dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], conv_L_cache=3),
    ),
    "jamba": (
        "JambaConfig",
        dict(
            num_hidden_layers=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_expand=1,
            mamba_dt_rank=8,
        ),
    ),  # fmt: skip
    "kimi-linear": (
        "KimiLinearConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=4,
            linear_attn_config={
                "kda_layers": [1],
                "full_attn_layers": [2],
                "num_heads": 4,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
        ),
    ),  # fmt: skip
    # hybrid models: Gated DeltaNet (linear attention with a recurrent state and a convolution of 4)
    # beside full attention; chunks of 64 hold a whole sequence here, so the tests' rows also cross
    # the chunked scan's chunks with chunk_size below
    "qwen3.5": (
        "Qwen3_5TextConfig",
        dict(
            num_hidden_layers=3,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        ),
    ),
    "qwen3-next": (
        "Qwen3NextConfig",
        dict(
            num_hidden_layers=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention"],
        ),
    ),
}


def moe_families() -> list[str]:
    """Every mixture-of-experts family transformers ships: the model types of its causal LMs whose
    default config names routed experts."""
    import transformers as t
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from rltrain.models.routers import config_experts

    found = []
    verbosity = t.logging.get_verbosity()
    t.logging.set_verbosity_error()  # (default configs warn of their own token ids)
    try:
        for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
            try:
                default = getattr(t, CONFIG_MAPPING_NAMES[model_type])()
            except Exception:  # noqa: BLE001 - a config without defaults (an encoder-decoder's)
                continue
            if config_experts(default):
                found.append(model_type)
    finally:
        t.logging.set_verbosity(verbosity)
    return found


# the tiny shapes of a mixture of experts, each key set where the family's config has it: 4 experts,
# top-2, one expert group, every layer routed
MOE_SHAPE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
                 moe_topk=2, n_group=1, topk_group=1, first_k_dense_replace=0, num_dense_layers=0,
                 moe_intermediate_size=32, shared_expert_intermediate_size=32, router_hidden_size=32)  # fmt: skip
# multi-head latent attention (DeepSeek's): the rotary part is the head the positions turn
MLA = dict(kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)
# what a family needs beyond that: its own layer kinds, a top-1 router, a MoE it switches on, an
# indexer and n-gram tables small enough
MOE = {model_type: {} for model_type in moe_families()}
MOE |= {
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "zaya": dict(num_experts_per_tok=1),
    "dbrx": dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=256,
                 attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                 ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    "doge": dict(is_moe=True, num_experts=16),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                  mamba_d_state=8, mamba_expand=1, mamba_dt_rank=8),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4, ngram_vocab_size_base=512, split_ngram_parts=4,
                           linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=2, hc_lowrank=16, ple_embed_dim=32),
}  # fmt: skip


def moe_config(model_type: str, **changes):
    """The tiny config of the mixture of experts ``model_type``: :data:`SHAPE` and :data:`MOE_SHAPE`
    where its config has the key (the head size always), two layers of each kind its defaults
    list, and what :data:`MOE` adds; ``changes`` last."""
    import transformers as t
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    cls = getattr(t, CONFIG_MAPPING_NAMES[model_type])
    default = cls()
    shape = {**SHAPE, "num_hidden_layers": 2, **MOE_SHAPE}
    kw = {k: v for k, v in shape.items() if hasattr(default, k) or k == "head_dim"}
    if getattr(default, "kv_lora_rank", None):
        kw |= {k: v for k, v in MLA.items() if hasattr(default, k)}
        kw |= {"num_key_value_heads": kw["num_attention_heads"], "head_dim": MLA["qk_rope_head_dim"]}
    for key in ("layer_types", "mlp_layer_types"):  # each kind the defaults list, in their order
        kinds = getattr(default, key, None)
        if kinds and not isinstance(getattr(cls, key, None), property):
            kw[key] = (list(dict.fromkeys(kinds)) * 2)[: kw["num_hidden_layers"]]
    return cls(**{**kw, **MOE.get(model_type, {}), **changes})


def build(family: str, attn_implementation: str | None = None, seed: int = 0, **changes) -> torch.nn.Module:
    """A freshly initialized tiny model of ``family`` (fp32, eval), its weights fixed by ``seed``;
    ``changes``: to its config."""
    torch.manual_seed(seed)
    made = config(family, **changes)
    auto = causal_lm_class(made)
    if not attention_interface(made):  # (its own attention, as the learners load it)
        attn_implementation = None
    # (a mixture's experts in plain torch: the grouped matmul kernel takes no float64)
    experts = {"experts_implementation": "eager"} if family in MOE else {}
    model = auto.from_config(made, attn_implementation=attn_implementation or "eager", **experts)
    prepare(model, needs(made, model))
    with torch.no_grad():  # attention sinks start at zero: give each head its own
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0.0, 1.0)
        for name, buffer in model.named_buffers():  # a trained model's routing biases and hash tables
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buffer.normal_(0.0, 0.05)
            elif name.endswith("tid2eid"):
                buffer.copy_(torch.randint_like(buffer, 0, int(buffer.max()) + made_experts(made)))
    return model.float().eval()


def made_experts(config) -> int:
    from rltrain.models.routers import config_experts

    return config_experts(getattr(config, "text_config", None) or config) or 1


def group_batch(seed: int = 0) -> TrainBatch:
    """One prompt of 14 tokens shared by three completions of 7, 12 and 9 tokens (left-padded
    prompts, right-padded completions, as rltrain.batch.collate lays them out); a fourth sequence
    of its own."""
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    prompt = draw(14)
    return laid_out([prompt, prompt, prompt, draw(5)], [draw(7), draw(12), draw(9), draw(10)])


def laid_out(prompts: list[list[int]], completions: list[list[int]]) -> TrainBatch:
    """Prompts left-padded and completions right-padded into one batch (as rltrain.batch.collate
    lays them out), the completions the response."""
    p, c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(len(prompts), p + c, dtype=torch.long)
    mask, response = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (pr, co) in enumerate(zip(prompts, completions)):
        ids[i, p - len(pr) : p] = torch.tensor(pr)
        ids[i, p : p + len(co)] = torch.tensor(co)
        mask[i, p - len(pr) : p + len(co)] = 1
        response[i, p : p + len(co)] = 1
    return TrainBatch(ids, mask, response, torch.ones_like(ids), torch.zeros(len(prompts)))


def alone(model: torch.nn.Module, batch: TrainBatch, weights: torch.Tensor):
    """Each sequence alone under the model's own attention (the reference): ``[B, T]`` log-probs in
    the batch's layout and every parameter's gradient of ``sum(weights * log-probs)``."""
    model.zero_grad()
    out = torch.zeros(batch.input_ids.shape)
    for b in range(len(batch)):
        keep = batch.attention_mask[b].bool()
        ids = batch.input_ids[b][keep][None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        lp = torch.cat([torch.zeros(1), logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]])
        (lp * weights[b][keep]).sum().backward()
        out[b, keep] = lp.detach()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def in_layout(model: torch.nn.Module, batch: TrainBatch, weights: torch.Tensor, layout: str):
    """The same through rltrain's forward of ``layout`` (``padded``, ``packed`` or ``tree``)."""
    model.zero_grad()
    if layout == "tree":
        tree = build_tree(batch.input_ids, batch.attention_mask, ~batch.response_mask.bool())
        lp, _ = tree_logprobs(model, tree, batch.input_ids)
    else:
        lp, _ = sequence_logprobs(model, batch.input_ids, batch.attention_mask, packed=layout == "packed")
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def float64_scans(family: str):
    """Inside: models of ``family`` computed in float64 throughout. Their recurrent layers' scans cast
    to float32 whatever the model's dtype (``torch.float32`` spelled in the modeling file); here the
    file's own ``torch`` reads ``float32`` as ``float64``, so a comparison sees the layout's
    arithmetic rather than fp32's rounding of a chunked scan (Gated DeltaNet's decay parameters'
    gradients differ by up to 6e-4 relative in fp32 between each sequence alone and padded rows,
    which run the same arithmetic on other chunk boundaries)."""
    from rltrain.forward.recurrent import recurrent_modules

    modules = recurrent_modules(build(family))
    lifted = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})
    lifted.float32 = torch.float64
    saved = [(m, m.torch) for m in modules]
    for m in modules:
        m.torch = lifted
    try:
        yield
    finally:
        for m, original in saved:
            m.torch = original


def worst_differences(
    family: str, layouts=("padded", "packed", "tree"), dtype=torch.float32
) -> dict[str, tuple[float, float]]:
    """For each layout: (the worst completion log-prob difference, the worst parameter-gradient
    difference relative to its norm) against each sequence alone under ``eager``; the models in
    ``dtype``."""
    batch = group_batch()
    # the completions' log-probs weighted at random: the loss's view of them (a padded row's first
    # token is predicted from padding, and a packed row's from another document: never a loss token)
    weights = (
        torch.randn(batch.input_ids.shape, generator=torch.Generator().manual_seed(1)) * batch.response_mask
    )
    reference, reference_grads = alone(build(family).to(dtype), batch, weights.to(dtype))
    keep = batch.response_mask.bool()
    out = {}
    for layout in layouts:
        model = build(family, attention.register()).to(dtype)
        lp, grads = in_layout(model, batch, weights.to(dtype), layout)
        grad_gap = max(
            ((grads[n] - g).norm() / g.norm().clamp(min=1e-12)).item() for n, g in reference_grads.items()
        )
        out[layout] = ((lp - reference)[keep].abs().max().item(), grad_gap)
    return out


def save_moe(model_type: str, folder, **changes):
    """A tiny model of the mixture of experts ``model_type`` written to ``folder`` with the built-in
    byte-level tokenizer, in shapes vLLM's CPU engine takes (heads of 32; experts of 32), its routing
    biases those of a trained model: a folder ``model.name_or_path`` takes. Returns the folder."""
    from rltrain.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    ids = dict(vocab_size=len(tokenizer), bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, max_position_embeddings=1024, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32)  # fmt: skip
    made = moe_config(model_type, **{**ids, **changes})
    if getattr(made, "kv_lora_rank", None):  # (multi-head latent attention: its rotary part is the head)
        made = moe_config(model_type, **{**ids, "num_key_value_heads": 2, "qk_rope_head_dim": 32, **changes})
    torch.manual_seed(0)
    model = causal_lm_class(made).from_config(made)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buffer.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
