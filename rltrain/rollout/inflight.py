"""In-flight weight updates: generation in chunks, so new weights can arrive between two of them.

With ``rollout.inflight_updates`` an engine generates each request ``rollout.inflight_chunk_tokens``
tokens at a time (:func:`generate_in_chunks`). Between two chunks it takes the newest weights it
was sent, and the request goes on from its sampled prefix (token-in: the prefix is fed back as
token ids, never re-tokenized text). Every token keeps the log-prob and the policy version of the
chunk that sampled it, so a completion can span several versions. A continuation samples with a
seed derived from the request's seed and the tokens already sampled (:func:`continuation_seed`):
a request that ends within its first chunk samples exactly what it would without chunks, and a run
whose weights arrive at the same chunk boundaries samples the same tokens.

Pure Python (no ray, no vllm): the engine passes its own chunk generator in.
"""

from __future__ import annotations

from collections.abc import Callable

from rltrain.batch import Segment, extend_routes

# generate(prompts, max_tokens, seeds) -> one Segment per prompt, each token's version filled in
ChunkFn = Callable[[list[list[int]], list[int], list[int]], list[Segment]]


def continuation_seed(seed: int, sampled: int) -> int:
    """The seed of a request's chunk after ``sampled`` tokens (the request's own seed at 0)."""
    if sampled == 0:
        return seed
    return (seed ^ (sampled * 0x9E3779B1)) % 2**31


def generate_in_chunks(
    generate: ChunkFn,
    prompts: list[list[int]],
    max_tokens: list[int],
    seeds: list[int],
    chunk: int,
    stop: list[str],
    decode: Callable[[list[int]], str],
) -> list[Segment]:
    """One segment per prompt, generated ``chunk`` tokens at a time; ``generate`` may run under
    newer weights from one call to the next. A stop string split over two chunks (which the engine,
    seeing only the second chunk's output, cannot find) ends the segment where it completes, as the
    engine would have; the text is decoded once from the whole segment's token ids."""
    out = [Segment([], [], "", "length") for _ in prompts]
    active = [i for i, m in enumerate(max_tokens) if m > 0]
    while active:
        parts = generate(
            [prompts[i] + out[i].token_ids for i in active],
            [min(chunk, max_tokens[i] - len(out[i].token_ids)) for i in active],
            [continuation_seed(seeds[i], len(out[i].token_ids)) for i in active],
        )
        still = []
        for i, part in zip(active, parts):
            seg, before = out[i], len(out[i].token_ids)
            seg.token_ids += part.token_ids
            seg.logprobs += part.logprobs
            seg.versions += part.versions
            seg.routes = extend_routes(seg.routes, part.routes)
            if part.finish_reason == "stop" or _cut_at_stop(seg, before, stop, decode):
                seg.finish_reason = "stop"
            elif len(seg.token_ids) < max_tokens[i] and part.token_ids:
                still.append(i)
        active = still
    for seg in out:
        seg.text = decode(seg.token_ids)
    return out


def _cut_at_stop(seg: Segment, before: int, stop: list[str], decode: Callable[[list[int]], str]) -> bool:
    """Whether a stop string completes after token ``before``; if so, cut the segment after it."""
    if not stop or not any(s in decode(seg.token_ids) for s in stop):
        return False
    for end in range(before + 1, len(seg.token_ids) + 1):
        if any(s in decode(seg.token_ids[:end]) for s in stop):
            del seg.token_ids[end:], seg.logprobs[end:], seg.versions[end:]
            return True
    return False
