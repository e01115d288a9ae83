"""Per-token log-probs and entropy from logits without a full float32 log-softmax (pure torch).

``logits.float().log_softmax(-1)`` on ``[B*T, V]`` bf16 logits allocates 4 bytes per vocabulary
entry per token (plus the same again for autograd), several GB at a 150k vocabulary. Here rows are
processed in chunks whose float32 working set stays under ``max_chunk_bytes``, and the backward pass
recomputes each chunk's softmax instead of saving it: the only extra memory autograd keeps is one
float per token (the log-normalizer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Truncation:
    """How the engine truncated the distribution it sampled from, after the temperature and in
    vLLM's order: ``min_p`` (drop tokens less likely than ``min_p`` x the most likely one), then
    ``top_k`` (keep the k largest logits, ties included; 0: off), then ``top_p`` (drop the least
    likely tokens whose probabilities sum to at most 1 - p, keeping at least one). Log-probs are
    then those of the renormalized rest, as the engine reports them."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __bool__(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


def truncation_keep(z_NV: torch.Tensor, targets_N: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """The tokens each row keeps under ``truncation`` (``z``: logits after the temperature), the
    target always among them: a token the engine sampled at the boundary of the kept set, where the
    engine's logits and these differ by float noise, keeps a finite log-prob."""
    keep = torch.ones_like(z_NV, dtype=torch.bool)
    if truncation.min_p > 0:
        probs = z_NV.softmax(-1)
        keep &= probs >= probs.amax(-1, keepdim=True) * truncation.min_p
    if 0 < truncation.top_k < z_NV.shape[-1]:
        kth = z_NV.masked_fill(~keep, float("-inf")).topk(truncation.top_k, dim=-1).values[:, -1:]
        keep &= z_NV >= kth
    if truncation.top_p < 1:
        sorted_z, order = z_NV.masked_fill(~keep, float("-inf")).sort(dim=-1)  # ascending
        dropped = sorted_z.softmax(-1).cumsum(-1) <= 1 - truncation.top_p
        dropped[:, -1] = False  # the most likely token stays
        keep &= ~torch.zeros_like(keep).scatter_(-1, order, dropped)
    return keep.scatter_(-1, targets_N[:, None], True)


def _scaled(logits_NV, targets_N, temperature: float, truncation: Truncation | None) -> torch.Tensor:
    """A float32 chunk of logits / temperature, its truncated tokens at -inf."""
    z = _upcast(logits_NV).div_(temperature)
    if truncation:
        z.masked_fill_(~truncation_keep(z, targets_N, truncation), float("-inf"))
    return z


def _rows_per_chunk(vocab_size: int, max_chunk_bytes: int) -> int:
    return max(1, max_chunk_bytes // (4 * vocab_size))


def _upcast(chunk: torch.Tensor) -> torch.Tensor:
    """A float32 *copy*: ``.float()`` on float32 returns the same storage, which in-place ops would
    then overwrite."""
    return chunk.to(torch.float32, copy=True)


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log_softmax(logits / T)[target] per row (and, optionally, the entropy), chunked in forward
    and backward. Each chunk is upcast once and worked on in place."""

    @staticmethod
    def forward(ctx, logits_NV, targets_N, temperature, rows_per_chunk, with_entropy, truncation):  # type: ignore[override]
        n = logits_NV.shape[0]
        logprobs_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
        lse_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
        entropy_N = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits_NV.device)
        for start in range(0, n, rows_per_chunk):
            rows = slice(start, start + rows_per_chunk)
            z = _scaled(logits_NV[rows], targets_N[rows], temperature, truncation)  # [chunk, V]
            lse = torch.logsumexp(z, dim=-1)
            lse_N[rows] = lse
            logprobs_N[rows] = z.gather(-1, targets_N[rows, None]).squeeze(-1) - lse
            if with_entropy:
                # H = lse - sum(softmax * z) (a truncated token: probability 0, its -inf made finite)
                finite = z.clamp(min=torch.finfo(z.dtype).min)
                entropy_N[rows] = lse - torch.exp(z - lse[:, None]).mul_(finite).sum(-1)
        ctx.save_for_backward(logits_NV, targets_N, lse_N)
        ctx.temperature, ctx.truncation = temperature, truncation
        ctx.rows_per_chunk = rows_per_chunk
        ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    def backward(ctx, grad_N, _grad_entropy):  # type: ignore[override]
        logits_NV, targets_N, lse_N = ctx.saved_tensors
        t, step = ctx.temperature, ctx.rows_per_chunk
        grad_logits_NV = torch.empty_like(logits_NV)
        for start in range(0, logits_NV.shape[0], step):
            rows = slice(start, start + step)
            # d logp[target] / d logits = (onehot(target) - softmax(logits / T)) / T
            g = grad_N[rows, None].float() / t
            # (the truncated tokens: softmax 0, no gradient; the kept set is piecewise constant)
            chunk = _scaled(logits_NV[rows], targets_N[rows], t, ctx.truncation)
            chunk = chunk.sub_(lse_N[rows, None]).exp_().mul_(-g)  # -g * softmax
            chunk.scatter_add_(-1, targets_N[rows, None], g)
            grad_logits_NV[rows] = chunk
        return grad_logits_NV, None, None, None, None, None


def token_logprobs(
    logits_BTV: torch.Tensor,
    token_ids_BT: torch.Tensor,
    temperature: float = 1.0,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    truncation: Truncation | None = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` at ``token_ids``: float32 ``[B, T]``, differentiable
    (with a ``truncation``: over the tokens it keeps).

    ``logits_BTV[:, t]`` must already be the prediction for ``token_ids_BT[:, t]`` (shift first).
    """
    return token_logprobs_and_entropy(
        logits_BTV, token_ids_BT, temperature, max_chunk_bytes, False, truncation
    )[0]


def token_logprobs_and_entropy(
    logits_BTV: torch.Tensor,
    token_ids_BT: torch.Tensor,
    temperature: float = 1.0,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    with_entropy: bool = True,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (differentiable) and entropy (no gradient) in one pass over the logits, ``[B, T]``
    each; with a ``truncation``, those of the truncated, renormalized distribution."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    *lead, vocab = logits_BTV.shape
    logits_NV = logits_BTV.reshape(-1, vocab)
    targets_N = token_ids_BT.reshape(-1).long()
    rows = _rows_per_chunk(vocab, max_chunk_bytes)
    logprobs, entropy = _SelectiveLogSoftmax.apply(
        logits_NV, targets_N, float(temperature), rows, with_entropy, truncation or None
    )
    return logprobs.reshape(lead), entropy.reshape(lead) if with_entropy else None


@torch.no_grad()
def token_entropy(
    logits_BTV: torch.Tensor, temperature: float = 1.0, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per position: float32 ``[B, T]``, no gradient."""
    zeros = torch.zeros(logits_BTV.shape[:-1], dtype=torch.long, device=logits_BTV.device)
    return token_logprobs_and_entropy(logits_BTV, zeros, temperature, max_chunk_bytes)[1]


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    packed: bool = False,
    truncation: Truncation | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token given its prefix under a causal LM: ``[B, T]`` (position 0 gets 0);
    with a ``truncation`` (the engine's top_k/top_p/min_p), of the distribution it sampled from.

    Position ``t`` holds ``log p(input_ids[t] | input_ids[:t])``, aligned with the input so a
    response mask over ``input_ids`` selects the response tokens' log-probs directly.

    ``packed=True`` runs the model on one padding-free row (:func:`packed_forward`) and scatters
    the result back to ``[B, T]``: the same values, without computing anything for padding.
    """
    if packed:
        return _packed_sequence_logprobs(
            model, input_ids_BT, attention_mask_BT, temperature, with_entropy, truncation
        )
    logits_BTV = padded_forward(model, input_ids_BT, attention_mask_BT).logits
    # logits at t predict token t+1
    logprobs, entropy = token_logprobs_and_entropy(
        logits_BTV[:, :-1], input_ids_BT[:, 1:], temperature, with_entropy=with_entropy, truncation=truncation
    )
    zero_col = logprobs.new_zeros(logprobs.shape[0], 1)
    logprobs_BT = torch.cat([zero_col, logprobs], dim=1)
    entropy_BT = None if entropy is None else torch.cat([zero_col, entropy], dim=1)
    return logprobs_BT, entropy_BT


def padded_forward(model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor):
    """The model's output for padded rows (left-padded prompts: positions count attended tokens)."""
    position_ids = (attention_mask_BT.long().cumsum(-1) - 1).clamp(min=0)
    return model(
        input_ids=input_ids_BT, attention_mask=attention_mask_BT, position_ids=position_ids, use_cache=False
    )


def token_outputs(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, packed: bool = False
) -> torch.Tensor:
    """The model's per-position output ``logits`` ``[B, T, C]`` for a head with few outputs (a value
    head), computed padded or on one packed row and laid out like the input (0 on padding)."""
    if not packed:
        return padded_forward(model, input_ids_BT, attention_mask_BT).logits
    keep_BT = attention_mask_BT.bool()
    out_1LC = packed_forward(model, *pack_sequences(input_ids_BT, attention_mask_BT)).logits
    out_BTC = out_1LC.new_zeros(*keep_BT.shape, out_1LC.shape[-1])
    return out_BTC.masked_scatter(keep_BT[..., None], out_1LC[0])


# ---------------------------------------------------------------------------- packed rows


def pack_sequences(
    input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attended tokens of every row, concatenated into one row: ``(input_ids_1L, position_ids_1L)``.

    Position ids restart at 0 for each sequence; that is how transformers tells the documents of
    a packed row apart. Each row's attended tokens must be contiguous (left-padded prompt,
    right-padded completion), as :func:`rltrain.batch.collate` lays them out.
    """
    keep_BT = attention_mask_BT.bool()
    position_ids_BT = attention_mask_BT.long().cumsum(-1) - 1
    return input_ids_BT[keep_BT][None], position_ids_BT[keep_BT][None]


def packed_forward(model: torch.nn.Module, input_ids_1L: torch.Tensor, position_ids_1L: torch.Tensor):
    """The model's output for a packed row, every document attending only to itself.

    transformers builds the block-diagonal causal mask from position ids that restart at 0, but only
    when it is given **no attention mask and no KV cache**: a 2-D mask (even all ones) or a cache
    object (Qwen2's config turns ``use_cache`` on) makes it fall back to one causal mask over the
    whole row, and documents silently attend to each other. Hence both are passed explicitly here.
    """
    return model(input_ids=input_ids_1L, position_ids=position_ids_1L, attention_mask=None, use_cache=False)


def _packed_sequence_logprobs(
    model, input_ids_BT, attention_mask_BT, temperature, with_entropy, truncation=None
):
    keep_BT = attention_mask_BT.bool()
    input_ids_1L, position_ids_1L = pack_sequences(input_ids_BT, attention_mask_BT)
    logits_1LV = packed_forward(model, input_ids_1L, position_ids_1L).logits
    logprobs_1L, entropy_1L = token_logprobs_and_entropy(
        logits_1LV[:, :-1], input_ids_1L[:, 1:], temperature, with_entropy=with_entropy, truncation=truncation
    )
    # a document's first token would be "predicted" by the previous document's last one: it gets 0,
    # as position 0 does in the padded layout
    starts_L = position_ids_1L[0] == 0

    def unpack(values_1L: torch.Tensor) -> torch.Tensor:
        values_L = torch.cat([values_1L.new_zeros(1), values_1L[0]])
        values_L = torch.where(starts_L, 0.0, values_L)
        return values_L.new_zeros(keep_BT.shape).masked_scatter(keep_BT, values_L)  # [B, T]

    return unpack(logprobs_1L), None if entropy_1L is None else unpack(entropy_1L)
