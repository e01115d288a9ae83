"""Per-token log-probs and entropy without a full float32 log-softmax, and without the model's
``[tokens, vocab]`` logits at all (pure torch).

``logits.float().log_softmax(-1)`` on ``[B*T, V]`` bf16 logits allocates 4 bytes per vocabulary
entry per token (plus the same again for autograd), several GB at a 150k vocabulary. Here rows are
processed in chunks whose float32 working set stays under ``max_chunk_bytes``, and the backward pass
recomputes each chunk's softmax instead of saving it: the only extra memory autograd keeps is one
float per token (the log-normalizer).

From a model's last hidden states and its output head (:func:`head_logprobs_and_entropy`) the
logits of only one chunk of tokens exist at a time, in the forward and again in the backward, which
recomputes them; how a model runs a row up to them is :mod:`rltrain.forward`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_MAX_CHUNK_BYTES = 64 * 2**20
HEAD_MIN_CHUNK_ROWS = 1024  # tokens of a chunk of the head's logits, at the least


@dataclass(frozen=True)
class Truncation:
    """How the engine truncated the distribution it sampled from, after the temperature and in
    vLLM's order: ``min_p`` (drop tokens less likely than ``min_p`` x the most likely one), then
    ``top_k`` (keep the k largest logits, ties included; 0: off), then ``top_p`` (drop the least
    likely tokens whose probabilities sum to at most 1 - p, keeping at least one). Log-probs are
    then those of the renormalized rest, as the engine reports them. ``banned``: tokens never
    sampled, left out before all of that (a vision-language model's image placeholders)."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    banned: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0 or bool(self.banned)


def truncation_keep(z_NV: torch.Tensor, targets_N: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """The tokens each row keeps under ``truncation`` (``z``: logits after the temperature), the
    target always among them: a token the engine sampled at the boundary of the kept set, where the
    engine's logits and these differ by float noise, keeps a finite log-prob."""
    keep = torch.ones_like(z_NV, dtype=torch.bool)
    if truncation.banned:
        keep[:, list(truncation.banned)] = False
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
    def forward(ctx, logits_NV, targets_N, temperature, rows_per_chunk, with_entropy, truncation, lse_N=None):  # type: ignore[override]
        # lse_N given: a recomputation (activation checkpointing) of a forward whose log-normalizers
        # are known; only what the backward needs is saved, the outputs are not used
        n = logits_NV.shape[0]
        logprobs_N = torch.zeros(n, dtype=torch.float32, device=logits_NV.device)
        entropy_N = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits_NV.device)
        if lse_N is None:
            lse_N = torch.empty(n, dtype=torch.float32, device=logits_NV.device)
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
        ctx.mark_non_differentiable(entropy_N, lse_N)
        return logprobs_N, entropy_N, lse_N

    @staticmethod
    def backward(ctx, grad_N, _grad_entropy, _grad_lse):  # type: ignore[override]
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
        return grad_logits_NV, None, None, None, None, None, None


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
    logprobs, entropy, _ = _SelectiveLogSoftmax.apply(
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


# ---------------------------------------------------------------------------- from hidden states


def head_logprobs_and_entropy(
    head: torch.nn.Module,
    hidden_BTH: torch.Tensor,
    token_ids_BT: torch.Tensor,
    temperature: float = 1.0,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    with_entropy: bool = True,
    truncation: Truncation | None = None,
    chunk_rows: int | None = None,
    agree_chunks: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs_and_entropy` of ``head(hidden_BTH)`` without those logits: the head
    runs on a chunk of tokens at a time, and under autograd each chunk is recomputed in the backward
    (activation checkpointing) rather than kept. ``head`` is the model's output module itself (a
    tied, LoRA-adapted or biased head computes as it does in the model's own forward, and its
    parameters get their gradients through it).

    A chunk holds ``chunk_rows`` tokens; by default as many as ``max_chunk_bytes`` of float32 logits
    hold, and at least :data:`HEAD_MIN_CHUNK_ROWS`: each chunk's backward adds a gradient the size of
    the head's whole weight, a cost that fewer, larger chunks share.

    ``agree_chunks``: where every call of a head with ZeRO-3 partitioned weights gathers its weight
    (forward, recomputation, backward: a collective), the number of chunks every rank of the group
    runs given this rank's (the most over ranks, one all-reduce of one integer); a rank with fewer
    tokens runs empty chunks up to it, so the gathers pair up."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    *lead, width = hidden_BTH.shape
    hidden_NH, targets_N = hidden_BTH.reshape(-1, width), token_ids_BT.reshape(-1).long()
    softmax_rows = _rows_per_chunk(_head_outputs(head), max_chunk_bytes)  # float32 working set
    step = chunk_rows or max(softmax_rows, HEAD_MIN_CHUNK_ROWS)
    params = list(head.parameters())
    recompute = (
        torch.is_grad_enabled()
        and (hidden_NH.requires_grad or any(p.requires_grad for p in params))
        # DeepSpeed ZeRO-3 does not gather a frozen parameter (a LoRA model's head) for a
        # recomputation in the backward: there each chunk's logits are kept, as the logits path does
        and not any(hasattr(p, "ds_id") and not p.requires_grad for p in params)
    )

    known: dict[int, torch.Tensor] = {}  # each chunk's log-normalizers, from its first forward

    def chunk(k: int, h_nH: torch.Tensor, t_n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # run again in the backward (recompute), it only rebuilds the logits the backward needs
        lse = known.get(k)
        logprobs, entropy, known[k] = _SelectiveLogSoftmax.apply(
            head(h_nH), t_n, float(temperature), softmax_rows, with_entropy and lse is None,
            truncation or None, lse,
        )  # fmt: skip
        return logprobs, entropy

    rows_N = hidden_NH.shape[0]
    chunks = -(-rows_N // step)
    if agree_chunks is not None and any(hasattr(p, "ds_id") for p in params):
        chunks = agree_chunks(chunks)  # (a rank with fewer tokens runs empty chunks: see above)
    parts = []
    for k in range(chunks):
        rows = slice(min(k * step, rows_N), min((k + 1) * step, rows_N))
        if recompute:
            parts.append(checkpoint(chunk, k, hidden_NH[rows], targets_N[rows], use_reentrant=False))
        else:
            parts.append(chunk(k, hidden_NH[rows], targets_N[rows]))
    if not parts:  # no tokens
        empty = hidden_NH.new_zeros(lead, dtype=torch.float32)
        return empty, empty if with_entropy else None
    logprobs = torch.cat([p[0] for p in parts]).reshape(lead)
    return logprobs, torch.cat([p[1] for p in parts]).reshape(lead) if with_entropy else None


def _head_outputs(head: torch.nn.Module) -> int:
    """The vocabulary size of an output head (its weight's rows; a ZeRO-3 partitioned weight keeps
    its full shape in ``ds_shape``)."""
    weight = head.weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def predicted_logprobs(
    states: torch.Tensor,
    head: torch.nn.Module | None,
    token_ids: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    truncation: Truncation | None,
    agree_chunks: Callable[[int], int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of ``token_ids`` from what a model's forward gave for the positions
    that predict them (:func:`rltrain.forward.head.head_forward`): hidden states and the head, or
    logits (``head`` None); ``agree_chunks``: see :func:`head_logprobs_and_entropy`."""
    if head is None:
        return token_logprobs_and_entropy(
            states, token_ids, temperature, with_entropy=with_entropy, truncation=truncation
        )
    return head_logprobs_and_entropy(head, states, token_ids, temperature, with_entropy=with_entropy,
                                     truncation=truncation, agree_chunks=agree_chunks)  # fmt: skip
