"""Sampling through the vLLM engines (the trainer's own generator actors): sampling sessions, each
bound to one set of weights (the base model, the adapters of one ``save_weights_for_sampler``, or
named sampler weights on disk), and the engines, which hold merged weights one set at a time
(loading another before a request that needs it) or adapters side by side. A sample never comes
from weights other than its session's: a snapshot taken before the last ``optim_step`` still
samples from that snapshot. Concurrent requests run together: each joins the engine's batch in
progress (continuous batching).

A request's sampling is its own (``num_samples``, ``max_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, stop strings or stop token ids), with each sampled token's log-prob (of the
distribution it was sampled from: after temperature and truncation, as the trainer's rollouts
report them) and the prompt's log-probs where asked (``compute_logprobs``). What the server does not
compute (top-k alternatives, a prompt's target log-probs) is refused.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rltrain.serve.futures import Fault
from rltrain.serve.wire import BadRequest, Body, shown

# what a sample request may ask beyond the served sampling; each must be off (its own sentence)
NOT_SERVED = {
    "topk_prompt_logprobs": "top-k prompt log-probs",
    "topk_sample_logprobs": "top-k sampled log-probs",
    "target_prompt_logprobs": "target prompt log-probs",
    "prompt_alt_tokens_k": "alternative prompt tokens",
    "record_stability_info": "stability records (stable_reinforce)",
}

NOT_HELD = ("this sampling client's weights are no longer held (newer snapshots took their place: "
            "serve.kept_snapshots, serve.snapshot_mib); save named sampler weights to sample from them later")  # fmt: skip


@dataclass
class Sampler:
    """A sampling session: whose it is, its base model, the weights it samples from (a key of
    :class:`Engines`), the ``tinker://`` path it was made from, if any, and the session it lives in
    (closed with it)."""

    sampler_id: str
    api_key: str
    base_model: str
    weights: str
    model_path: str | None = None
    session_id: str = ""


@dataclass
class SampleCall:
    prompt: list[int]
    num_samples: int
    sampling: dict
    prompt_logprobs: bool
    last_n: int | None = None  # prompt log-probs of the last n tokens alone (the others None)

    def request(self) -> tuple[list[int], int, dict, bool]:
        """As the engines take it (:meth:`rltrain.rollout.engines.GeneratorPool.sample`)."""
        return self.prompt, self.num_samples, self.sampling, self.prompt_logprobs

    def scored(self, prompt: list | None) -> list | None:
        """The prompt's log-probs as asked: all of them, or the last ``last_n``."""
        if prompt is None or self.last_n is None:
            return prompt
        return [None] * (len(prompt) - self.last_n) + prompt[len(prompt) - self.last_n :]


def sample_call(body: dict, vocab: int, context: int) -> SampleCall:
    """A ``asample`` request's prompt and sampling, checked: tokens in the vocabulary, the prompt
    and its completion within the engines' ``context``
    (:func:`~rltrain.serve.models.engine_context`), each setting in range; anything else
    :class:`BadRequest`."""
    body = body if isinstance(body, Body) else Body(body, "asample")
    for key, what in NOT_SERVED.items():
        if body.get(key):
            raise BadRequest(f"asample: {what} ({key}) are not served")
    tokens: list[int] = []
    for i, chunk in enumerate(body.object("prompt").array("chunks")):
        chunk = Body(chunk if isinstance(chunk, dict) else {"type": chunk}, f"asample: prompt.chunks[{i}]")
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise BadRequest(
                f"prompt.chunks[{i}]: only token chunks are served (got {shown(chunk.get('type'))})"
            )
        ids = chunk.array("tokens")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest(f"asample: prompt.chunks[{i}].tokens must be integers")
        tokens += ids
    if not tokens:
        raise BadRequest("asample: the prompt holds no tokens")
    if min(tokens) < 0 or max(tokens) >= vocab:
        raise BadRequest(f"asample: prompt token ids outside the vocabulary of {vocab}")
    n = body.whole("num_samples", 1)
    if not 1 <= n <= 1024:
        raise BadRequest(f"asample: num_samples {n} (1 to 1024)")
    params = body.object("sampling_params")
    room = context - len(tokens)
    if room < 1:
        raise BadRequest(f"asample: a prompt of {len(tokens)} tokens leaves no room in the engines' context of "
                         f"{context} (rollout.max_model_len, at most the model's own)")  # fmt: skip
    max_tokens = params.whole("max_tokens", room)
    if max_tokens < 1 or max_tokens > room:
        raise BadRequest(f"asample: max_tokens {max_tokens} with a prompt of {len(tokens)} tokens: the engines' "
                         f"context of {context} leaves room for 1 to {room}")  # fmt: skip
    temperature = params.number("temperature", 1.0)
    top_p, top_k = params.number("top_p", 1.0), params.whole("top_k", -1)
    if temperature < 0:
        raise BadRequest(f"asample: temperature {temperature} (0 or more)")
    if not 0 < top_p <= 1:
        raise BadRequest(f"asample: top_p {top_p} (above 0, 1 at most)")
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"asample: top_k {top_k} (-1 for none, or 1 or more)")
    sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    seed = params.whole("seed", None, low=0, high=(1 << 63) - 1)
    if seed is not None:
        sampling["seed"] = seed
    stop = params.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not isinstance(stop, list):
        raise BadRequest("asample: stop is a string, a list of strings, or a list of token ids")
    if stop is not None and len(stop) == 0:
        sampling["ignore_eos"] = True  # [] disables every stop, the end of sequence included
    elif stop is not None and all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        if min(stop) < 0 or max(stop) >= vocab:
            raise BadRequest(f"asample: stop token ids outside the vocabulary of {vocab}")
        sampling["stop_token_ids"] = list(stop)
    elif stop is not None:
        if not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("asample: stop is a string, a list of strings, or a list of token ids")
        sampling["stop"] = list(stop)
    last_n = body.whole("prompt_logprobs_last_n")
    if last_n is not None and not (body.flag("prompt_logprobs") and 1 <= last_n < len(tokens)):
        raise BadRequest(f"asample: prompt_logprobs_last_n {last_n} with prompt log-probs of {len(tokens)} tokens "
                         f"(1 to {len(tokens) - 1})")  # fmt: skip
    return SampleCall(tokens, n, sampling, body.flag("prompt_logprobs"), last_n)


class Engines:
    """The generator pool (started at the first need, for the base model and LoRA layout asked) and the weights
    it holds: every set a sampling session may need, by key (in the Ray object store, the last
    ``keep`` snapshots; named ones reload from disk). Merged weights (a model that trains the output
    head) are held one set at a time, loaded before a request that needs them once the requests on
    other weights have finished; adapters are served side by side (vLLM's LoRA: each request names
    its own, and requests of different keys run in one batch, none waiting for another's weights)."""

    def __init__(self, keep: int, budget_bytes: float = float("inf")):
        self.keep, self.budget = keep, budget_bytes
        self.sizes: dict[str, int] = {}  # key -> bytes of its weights in the object store
        self.pool = None
        self.pool_key: tuple | None = None
        self.states: OrderedDict[str, object] = OrderedDict()  # key -> object ref of the tensors
        self.loaders: dict[str, Callable[[], object]] = {}  # key -> makes its ref (named: from disk)
        self.held: str | None = None
        self.last = None  # the last adapters loaded (the base is them zeroed)
        self.version = 0
        self._active = 0
        self._cond = threading.Condition()
        self._start: Callable[[], object] | None = None  # what starts the pool again after a death
        self.side_by_side = False  # the engines serve adapters, each key's its own (no swapping)
        # side by side: key -> its adapter in the engines, the least recently used first
        self._adapters: OrderedDict[str, int] = OrderedDict()
        self._uses: dict[int, int] = {}  # adapter -> requests on it in flight
        self._retired: set[int] = set()  # adapters of replaced or let-go keys, dropped once unused
        self._adapter_ids = itertools.count(1)

    def ensure(self, pool_key: tuple, start: Callable[[], object], base: Callable[[], object] | None) -> None:
        """The pool for ``pool_key`` (the model path and its LoRA layout): kept if it is the one
        running, otherwise the running one shut down and ``start()`` the new one; ``base`` makes
        the base model's weights (None: the engines take adapters, served side by side)."""
        with self._cond:
            while self._active:
                self._cond.wait()
            if self.pool_key == pool_key:
                return
            if self.pool is not None:
                self.pool.shutdown()
            self.pool, self.pool_key, self.held = None, None, None
            self.states.clear()
            self.sizes.clear()
            self.loaders.clear()
            self.pool, self.pool_key, self._start = start(), pool_key, start
            self.held = "base"  # a fresh engine holds the base model (no adapter yet)
            self.side_by_side = base is None
            self._forget_adapters()
            if base is not None:
                self.loaders["base"] = base

    def add(self, key: str, ref=None, loader: Callable[[], object] | None = None, load: bool = False) -> None:
        """Hold ``key``'s weights (``ref``, or ``loader`` to make it when needed); ``load``: the
        engines take them now, as a training step's sync would."""
        with self._cond:
            if ref is not None:
                if self.held == key:  # new weights under a held name: the engines take them again
                    self.held = None
                if key in self._adapters:  # (side by side: under a new adapter; the old one retires)
                    self._retire(self._adapters.pop(key))
                self.states.pop(key, None)
                self.states[key], self.sizes[key] = ref, object_bytes(ref)
                self._evict()
            if loader is not None:
                self.loaders[key] = loader
        if load:
            pool = self.pool
            try:
                with self._turn(key):
                    pass
            except Exception as error:
                if not _died(error):
                    raise
                raise self._revived(pool, error, "taking new weights") from None

    def _evict(self) -> None:
        """(Holding the lock.) The oldest snapshots let go (named ones reload from disk) while more
        than ``keep`` are held or they take more than the budget's bytes; the newest always stays."""
        while len(self.states) > 1 and (
            len(self.states) > self.keep or sum(self.sizes[k] for k in self.states) > self.budget
        ):
            key = self.states.popitem(last=False)[0]
            self.sizes.pop(key, None)
            if key in self._adapters and key not in self.loaders:  # (nothing can sample from it again)
                self._retire(self._adapters.pop(key))

    def sample(self, key: str, call: SampleCall) -> tuple[list, list | None]:
        """(On a request's thread.) The samples of ``call`` from ``key``'s weights. Requests on the
        same weights run at once: each joins the engine's batch in progress at its next step
        (:meth:`rltrain.rollout.backends.VLLMBackend.sample`), as vLLM's own server batches; a
        request that fails fails alone."""
        import ray

        pool = self.pool
        try:
            with self._turn(key) as adapter:  # (the weights held until the request is done)
                return ray.get(self.pool.sample([call.request()], adapter))[0]
        except Exception as e:
            if _died(e):
                raise self._revived(pool, e, "sampling") from None
            raise

    def _revived(self, pool, error: Exception, doing: str) -> Fault:
        """The engines of ``pool`` died (or stopped answering): a new pool in its place, started
        once by whoever saw it first, holding the base model until a request loads its weights;
        the sentence the requests that saw it fail with."""
        with self._cond:
            if self.pool is pool and pool is not None:
                with contextlib.suppress(Exception):
                    pool.shutdown()
                self.pool, self.held = self._start(), "base"
                self.version += 1
                self._forget_adapters()
        return Fault(f"the engines died while {doing} ({error}); they were restarted: send the request again")

    def known(self, key: str) -> bool:
        return key == "base" or key in self.states or key in self.loaders

    @contextlib.contextmanager
    def _turn(self, key: str):
        """The engines holding ``key``'s weights for the length of the block, which gets the adapter
        a request names (None: the weights the engines hold). Merged weights switch once the requests
        on other weights have finished; adapters side by side are taken at once."""
        if self.side_by_side:
            with self._cond:
                adapter = self._adapter(key)
                self._uses[adapter] = self._uses.get(adapter, 0) + 1
            try:
                yield adapter
            finally:
                with self._cond:
                    if adapter in self._uses:  # (not if the engines died and were restarted meanwhile)
                        self._uses[adapter] -= 1
                    self._drop_retired()
            return
        with self._cond:
            while self.held != key and self._active:
                self._cond.wait()
            if self.held != key:
                self._load(key)
            self._active += 1
        try:
            yield None
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    def _adapter(self, key: str) -> int | None:
        """(Holding the lock.) ``key``'s adapter in the engines, given to them if they have none
        for it (the least recently used past ``keep`` retire). The base model is adapters of zeros
        once any adapter is held (vLLM's LoRA layers otherwise apply the last one's to a request
        without any), and no adapter before."""
        if key == "base" and self.last is None:
            return None
        if key not in self._adapters:
            ref = self._weights(key)
            adapter = next(self._adapter_ids)
            self.pool.hold_adapter(adapter, ref)
            self._adapters[key] = adapter
            self.last = ref
            while len(self._adapters) > self.keep:
                self._retire(self._adapters.popitem(last=False)[1])
        self._adapters.move_to_end(key)
        return self._adapters[key]

    def _retire(self, adapter: int) -> None:
        self._retired.add(adapter)
        self._drop_retired()

    def _drop_retired(self) -> None:
        """(Holding the lock.) The engines let go of the retired adapters no request is on."""
        for adapter in [a for a in self._retired if not self._uses.get(a)]:
            self._retired.discard(adapter)
            self._uses.pop(adapter, None)
            with contextlib.suppress(Exception):  # (engines that died hold none: restarted when next used)
                self.pool.drop_adapter(adapter)

    def _forget_adapters(self) -> None:
        """(Holding the lock.) A new pool holds no adapter."""
        self.last = None
        self._adapters.clear()
        self._uses.clear()
        self._retired.clear()

    def _load(self, key: str) -> None:
        """(Holding the lock, no request in flight.) The engines take ``key``'s weights."""
        ref = self._weights(key)
        self.version += 1
        self.pool.load_weights(ref, self.version)
        self.held = key
        if key != "base":
            self.last = ref

    def _weights(self, key: str):
        """(Holding the lock.) The object ref of ``key``'s weights; the base model's, where the
        engines take adapters, are the last adapters zeroed (B @ A = 0), in the shape they hold."""
        import ray

        if key == "base" and key not in self.loaders:
            return ray.put({k: v.new_zeros(v.shape) for k, v in ray.get(self.last).items()})
        if key in self.states:
            return self.states[key]
        if key in self.loaders:
            return self.loaders[key]()
        raise BadRequest(NOT_HELD)

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
            self.pool = None


def object_bytes(ref) -> int:
    """The size of an object in Ray's object store (0 where Ray does not know it yet)."""
    from ray.experimental import get_object_locations

    return int(get_object_locations([ref]).get(ref, {}).get("object_size") or 0)


def base_loader(model_path: str) -> Callable[[], object]:
    """What puts the base model's own weights in the object store (engines that took merged
    weights go back to the base with them)."""

    def load():
        import ray
        from safetensors.torch import load_file

        state = {}
        for file in sorted(Path(model_path).glob("*.safetensors")):
            state |= load_file(str(file))
        return ray.put(state)

    return load


def _died(error: Exception) -> bool:
    """Whether ``error`` says an engine died or stopped answering (not that a request was wrong)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    from rltrain.remote import ActorFailure

    return isinstance(error, RayActorError | ActorUnavailableError | ActorFailure)
