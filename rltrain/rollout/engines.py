"""Generator actors: each owns a backend (:mod:`rltrain.rollout.backends`: vLLM or transformers)
and stamps the policy version of its weights on every token it samples; :class:`GeneratorActor`
adds tool calls and episodes on top (:func:`rltrain.episodes.tools.generate_with_tools`);
:class:`GeneratorPool` spreads requests over the engines.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any

import ray
import torch

from rltrain import weight_transfer
from rltrain.batch import Completion, Segment
from rltrain.config import Config
from rltrain.episodes.tools import STOP, ToolRunner, generate_with_tools
from rltrain.episodes.turns import Episodes
from rltrain.models.adapters import is_adapter
from rltrain.models.images import is_vision_parameter
from rltrain.remote import gather, where
from rltrain.rollout.backends import GeneratorBackend, VLLMBackend, decode
from rltrain.rollout.hf_backend import HFBackend
from rltrain.rollout.inflight import generate_in_chunks


class GeneratorActor:
    """One generation engine plus the tool loop, or the episodes of an environment
    (:func:`~rltrain.episodes.turns.run_episodes`). Created by :class:`GeneratorPool` as a Ray actor.

    It knows the policy version of its weights (the training steps behind them, sent with them)
    and stamps it on every token it samples. Without ``rollout.inflight_updates`` new weights wait
    for every rollout submitted before them, so which weights sample a step is a function of the
    run's seed; with it they are taken between two decode steps of the rollout in progress
    (:meth:`VLLMBackend.generate_inflight`) or two chunks (:mod:`rltrain.rollout.inflight`: the
    transformers backend, and vLLM serving LoRA adapters).
    """

    def __init__(self, config: Config, model_path: str, engine_index: int, lora: bool = False):
        from transformers import AutoTokenizer

        rc = config.rollout
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=config.model.trust_remote_code
        )
        self.tools = ToolRunner.from_config(rc.tools) if rc.tools.enabled else None
        self.stop = [STOP] if self.tools else []
        self.episodes, self.agents = None, None
        if config.gateway_episodes:
            from rltrain.episodes.agents import AgentRunner

            self.agents = AgentRunner(config, self.tokenizer, model_path)
            self.stop = []  # (rollout.tools are not an episode's: its tools are the agent's or the task's)
        elif config.env.name is not None:
            self.episodes = Episodes(config, self.tokenizer, self.encode, model_path)
            self.stop = self.episodes.parser.stop
        if rc.backend == "vllm":
            self.backend: GeneratorBackend = VLLMBackend(
                model_path, rc, self.stop, config.run.seed + engine_index, config.model.lora if lora else None
            )
        else:
            self.backend = HFBackend(
                model_path, rc, self.stop, config.model.trust_remote_code, config.model.lora if lora else None
            )
        self.version = 0
        self._engine = threading.RLock()  # the backend runs one call at a time
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None  # weights not taken yet
        self._loaded_names: list[str] = []  # of the last weights taken
        self._pending_lock = threading.Lock()
        self._busy_s, self._since = 0.0, None  # seconds in finished rollouts; the one running since
        self.weight_group = None  # rollout.weight_sync=collective: this engine's member of the weight group
        self._received: dict[int, dict[str, torch.Tensor]] = {}  # by version, over the collective

    def rollout(self, requests: list, seeds: list[int], greedy: bool = False) -> list[Completion]:
        """A completion per request: a prompt's token ids, or with an environment a data row."""
        rc = self.config.rollout
        generate = functools.partial(self.generate, greedy=greedy)
        start = self._since = time.perf_counter()
        try:
            with contextlib.nullcontext() if rc.inflight_updates else self._engine:  # else one version
                if self.episodes is not None:
                    return self.episodes.run(generate, requests, seeds)
                if self.agents is not None:
                    return self.agents.run(generate, requests, seeds)
                return generate_with_tools(
                    generate, self.encode, requests, rc.max_new_tokens, self.tools, rc.tools.max_calls, seeds
                )
        finally:
            self._busy_s += time.perf_counter() - start
            self._since = None

    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], seeds: list[int], greedy: bool = False
    ) -> list[Segment]:
        """The backend's segments with each token's version; in chunks with in-flight updates."""
        rc = self.config.rollout

        def stamped(prompts: list[list[int]], max_tokens: list[int], seeds: list[int]) -> list[Segment]:
            with self._engine:
                self._take_weights()
                segments = self.backend.generate(prompts, max_tokens, seeds, greedy)
                for seg in segments:
                    seg.versions = [self.version] * len(seg.token_ids)
            return segments

        if not rc.inflight_updates:
            return stamped(prompts, max_tokens, seeds)
        if isinstance(self.backend, VLLMBackend) and self.backend.adapters is None:  # between decode steps
            with self._engine:
                self._take_weights()
                self.backend.reset_stale_prefixes()  # no request of this call reuses older weights' KV
                return self.backend.generate_inflight(prompts, max_tokens, seeds, greedy, self._between_steps)
        # otherwise between chunks, each request going on from its sampled prefix (vLLM binds a
        # LoRA adapter to a request when it starts: each chunk is a request of the newest adapter)
        detokenize = functools.partial(decode, self.tokenizer)
        return generate_in_chunks(
            stamped, prompts, max_tokens, seeds, rc.inflight_chunk_tokens, self.stop, detokenize
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def complete(self, prompts: list[list[int]], max_tokens: int) -> list[str]:
        """Greedy replies to plain prompts (a judge's: no tools, no episodes), with the weights
        the engine holds now."""
        with self._engine:
            self._take_weights()
            segments = self.backend.generate(prompts, [max_tokens] * len(prompts), [0] * len(prompts), True)
        return [seg.text for seg in segments]

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int = 0) -> None:
        """Take the weights of policy ``version``. Sent in order with the rollouts (the default
        concurrency group), after every rollout submitted before them; with in-flight updates sent
        beside them (the ``weights`` group) and taken at the next decode step or chunk boundary of
        the rollout in progress (returns at once)."""
        with self._pending_lock:
            if not state_dict and self._pending is not None:  # a new version of weights not yet taken
                state_dict = self._pending[0]
            self._pending = (state_dict, version)
        if not self.config.rollout.inflight_updates:
            with self._engine:  # waits for the rollout in progress
                self._take_weights()
        elif self._engine.acquire(blocking=False):  # idle: take them now
            try:
                self._take_weights()
            finally:
                self._engine.release()

    def device_key(self) -> str | None:
        return weight_transfer.device_key()

    @ray.method(concurrency_group="health")  # answers while every other call waits
    def alive(self) -> bool:
        return True

    def open_weight_group(self, address: str, port: int, rank: int, world_size: int, backend: str,
                          timeout_s: float) -> None:  # fmt: skip
        """Join the weight group (:mod:`rltrain.weight_transfer`) as member ``rank``."""
        self.weight_group = weight_transfer.open_group(address, port, rank, world_size, backend, timeout_s)

    @ray.method(concurrency_group="weights")  # at once, beside a rollout in progress
    def receive_weights(self, layout: weight_transfer.Layout, version: int, now: bool) -> None:
        """The weights of policy ``version`` over the weight group. ``now`` (no rollout is in
        flight or waiting on this engine): loaded bucket by bucket as they arrive; otherwise held
        until :meth:`take_received`, which keeps the place of :meth:`load_weights` among the
        rollouts."""
        arriving = weight_transfer.receive(self.weight_group, layout)
        if not now:
            self._received[version] = weight_transfer.on_host(arriving)
            return
        with self._engine, self._pending_lock:
            self._pending = None  # (older weights not taken yet: these replace them)
            self.backend.load_weights(arriving)
            self._loaded_names, self.version = layout.names, version

    def take_received(self, version: int) -> None:
        """:meth:`load_weights` with the weights received for ``version``."""
        self.load_weights(self._received.pop(version), version)

    def _between_steps(self) -> int:
        self._take_weights()
        return self.version

    def _take_weights(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            if pending[0]:  # (no weights: the same ones, as a new policy version)
                self.backend.load_weights(pending[0].items())
                self._loaded_names = list(pending[0])
            self.version = pending[1]

    @ray.method(concurrency_group="weights")  # answers beside a rollout in progress
    def busy_seconds(self) -> float:
        """Seconds spent generating rollouts since the engine started (the one running included)."""
        since = self._since
        return self._busy_s + (time.perf_counter() - since if since is not None else 0.0)

    def where(self) -> dict[str, Any]:
        return where()

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        with self._engine:
            self._take_weights()
            return self.backend.prompt_logprobs(sequences)

    @ray.method(concurrency_group="sampling")  # concurrent calls join the batch in progress
    def sample(self, requests: list[tuple[list[int], int, dict, bool]], adapter: int | None = None) -> list:
        """The backend's :meth:`~rltrain.rollout.backends.VLLMBackend.sample` with the weights the
        engine took last, or the held ``adapter`` over them; calls that arrive while others run
        join their batch."""
        with self._engine:
            self._take_weights()
        return self.backend.sample(requests, self._engine, adapter)

    def hold_adapter(self, adapter: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Serve these LoRA adapters as ``adapter``, beside the others held (sample requests name it)."""
        with self._engine:
            self.backend.hold_adapter(adapter, state_dict)

    def drop_adapter(self, adapter: int) -> None:
        with self._engine:
            self.backend.drop_adapter(adapter)

    def weights_not_loaded(self) -> list[str]:
        """The engine's parameters that no name of the last weights it took loads (all of them
        before any sync)."""
        if self._loaded_names and all(map(is_adapter, self._loaded_names)):
            return []  # an adapter over an unchanged base: no base weight is meant to arrive
        with self._engine:
            missing = self.backend.not_loaded(self._loaded_names)
        # (a frozen vision side is never sent: the engine holds it from the start)
        return [n for n in missing if not (self.config.model.freeze_vision and is_vision_parameter(n))]


class GeneratorPool:
    """``rollout.num_engines`` generator actors; requests are spread evenly over them."""

    def __init__(self, config: Config, model_path: str, lora: bool = False, sampling_threads: int = 1):
        """``lora``: the engines take the policy's LoRA adapters (``model.lora``), not full weights.
        ``sampling_threads``: the :meth:`GeneratorActor.sample` calls an engine takes at once, each
        joining the batch in progress (a server's; a training run samples none)."""
        rc = config.rollout
        # in-flight weights and the busy-time probe answer beside a rollout in progress
        # (and whether the process answers at all, beside a call blocked in the weight group)
        # and sample requests beside each other (a thread each)
        groups = {"weights": 1, "health": 1, "sampling": sampling_threads}
        actor_cls = ray.remote(concurrency_groups=groups)(GeneratorActor).options(
            num_cpus=rc.cpus_per_engine, num_gpus=rc.gpus_per_engine
        )
        self.actors = [actor_cls.remote(config, model_path, i, lora) for i in range(rc.num_engines)]
        self.names = [f"generator {i}" for i in range(rc.num_engines)]
        self.size, self.inflight = rc.num_engines, rc.inflight_updates
        self.timeout_s = config.run.actor_timeout_s
        self._submitted: dict[ray.ObjectRef, str] = {}  # in flight: which generator answers
        self._loading: list[ray.ObjectRef] = []  # weights queued behind rollouts in flight (settle)
        self._turn = -1  # the engine the last sample request went to

    def submit(self, requests: list, seeds: list[int], greedy: bool = False) -> list[ray.ObjectRef]:
        """Start generating (non-blocking) from prompts' token ids or, with an environment, data
        rows; :meth:`collect` the returned references."""
        chunks = _split(list(range(len(requests))), len(self.actors))
        refs = []
        for actor, name, idx in zip(self.actors, self.names, chunks):
            if idx:
                refs.append(actor.rollout.remote([requests[i] for i in idx], [seeds[i] for i in idx], greedy))
                self._submitted[refs[-1]] = name
        return refs

    def complete(self, prompts: list[list[int]], max_tokens: int, timeout_s: float) -> list[str | None]:
        """Greedy replies to plain prompts, spread over the engines; None for the replies of an
        engine that has not answered within ``timeout_s`` (it finishes them, bounded by
        ``max_tokens``, and nothing waits for them); an engine that died raises ActorFailure."""
        chunks = _split(list(range(len(prompts))), len(self.actors))
        calls = [(idx, name, actor.complete.remote([prompts[i] for i in idx], max_tokens))
                 for actor, name, idx in zip(self.actors, self.names, chunks) if idx]  # fmt: skip
        ready, _ = ray.wait([ref for *_, ref in calls], num_returns=len(calls), timeout=timeout_s)
        replies: list[str | None] = [None] * len(prompts)
        for idx, name, ref in calls:
            if ref in ready:
                for i, text in zip(idx, gather([ref], [name], self.timeout_s)[0]):
                    replies[i] = text
        return replies

    def collect(self, refs: list[ray.ObjectRef]) -> list[Completion]:
        """The completions, in submission order; a generator that dies or passes
        run.actor_timeout_s raises :class:`~rltrain.remote.ActorFailure`."""
        self.settle()
        names = [self._submitted.pop(ref, "generator") for ref in refs]
        return [c for part in gather(refs, names, self.timeout_s) for c in part]

    def load_weights(self, state_ref: ray.ObjectRef, version: int) -> None:
        """Every engine takes the weights of policy ``version`` (with in-flight updates, at its
        next chunk boundary)."""
        self._load("load_weights", state_ref, version)

    def take_received(self, version: int) -> None:
        """:meth:`load_weights` with the weights each engine received over the weight group."""
        self._load("take_received", version)

    def _load(self, method: str, *args: Any) -> None:
        """Every engine's ``method``: beside the rollouts in flight (in-flight updates), or queued
        after them, in order with the rollouts. Queued after a rollout in flight, it is not waited
        for here (the push returns at the copy's pace, not the rollout's): the next call that reads
        the engines waits for it first (:meth:`settle`), and the rollouts submitted after it take
        its weights, as the actor runs its calls in order."""
        self.settle()
        group = "weights" if self.inflight else None  # beside the rollouts in flight, or after them
        refs = [getattr(a, method).options(concurrency_group=group).remote(*args) for a in self.actors]
        if self._submitted and group is None:
            self._loading = refs
        else:
            gather(refs, self.names, self.timeout_s)

    def settle(self) -> None:
        """Wait for weights queued behind rollouts to be taken (their errors raise here)."""
        loading, self._loading = self._loading, []
        if loading:
            gather(loading, self.names, self.timeout_s)

    def device_keys(self) -> list[str | None]:
        """Each engine's GPU (:func:`rltrain.weight_transfer.device_key`)."""
        return gather([a.device_key.remote() for a in self.actors], self.names, self.timeout_s)

    def open_weight_group(
        self, address: str, port: int, backend: str, timeout_s: float
    ) -> list[ray.ObjectRef]:
        """Every engine joins the weight group (ranks 1 and up; the sender is rank 0): the calls,
        to be awaited together with the sender's."""
        world = self.size + 1
        return [a.open_weight_group.remote(address, port, i + 1, world, backend, timeout_s)
                for i, a in enumerate(self.actors)]  # fmt: skip

    def silent(self, names: list[str], timeout_s: float = 2.0) -> list[str]:
        """Which of the generators ``names`` do not answer at all within ``timeout_s`` (a process
        stopped or stuck outside Python), as against one that waits on a peer."""
        refs = {self.actors[self.names.index(name)].alive.remote(): name for name in names}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        return [name for ref, name in refs.items() if ref not in ready]

    def receive_weights(self, layout: Any, version: int) -> tuple[list[ray.ObjectRef], bool]:
        """Every engine receives a collective sync: the calls (awaited with the sender's), and
        whether the engines load the weights as they arrive (no rollout was in flight: nothing
        submitted before the weights can take them) or hold them for :meth:`take_received`."""
        now = not self._submitted
        return [a.receive_weights.remote(layout, version, now) for a in self.actors], now

    def bump_version(self, version: int) -> None:
        """The engines' weights, unchanged, become policy ``version`` (a step without an update):
        nothing is sent but the number."""
        self.load_weights(ray.put({}), version)

    def busy_seconds(self) -> float:
        """Seconds the engines have spent generating rollouts since they started, summed."""
        return sum(gather([a.busy_seconds.remote() for a in self.actors], self.names, self.timeout_s))

    def prompt_logprobs(self, sequences: list[list[int]], every: bool = False) -> list[list[float]]:
        """The first engine's :meth:`GeneratorBackend.prompt_logprobs`; ``every``: a list of every
        engine's."""
        self.settle()
        actors, names = (self.actors, self.names) if every else (self.actors[:1], self.names[:1])
        answers = gather([a.prompt_logprobs.remote(sequences) for a in actors], names, self.timeout_s)
        return answers if every else answers[0]

    def sample(
        self, requests: list[tuple[list[int], int, dict, bool]], adapter: int | None = None
    ) -> ray.ObjectRef:
        """Requests generated together (:meth:`GeneratorActor.sample`) on the next engine in turn."""
        self._turn = (self._turn + 1) % self.size
        return self.actors[self._turn].sample.remote(requests, adapter)

    def hold_adapter(self, adapter: int, state_ref: ray.ObjectRef) -> None:
        """Every engine serves these adapters as ``adapter`` beside the others it holds."""
        gather([a.hold_adapter.remote(adapter, state_ref) for a in self.actors], self.names, self.timeout_s)

    def drop_adapter(self, adapter: int) -> None:
        gather([a.drop_adapter.remote(adapter) for a in self.actors], self.names, self.timeout_s)

    def weights_not_loaded(self) -> list[str]:
        """The parameters of any engine that the last weights it took do not load, each named once."""
        self.settle()
        answers = gather([a.weights_not_loaded.remote() for a in self.actors], self.names, self.timeout_s)
        return list(dict.fromkeys(name for names in answers for name in names))

    def where(self) -> list[dict[str, Any]]:
        """Node, address and pid of every generator."""
        places = gather([a.where.remote() for a in self.actors], self.names)
        return [{"actor": name, **w} for name, w in zip(self.names, places)]

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


def _split(items: list[int], parts: int) -> list[list[int]]:
    k, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + k + (i < r)
        out.append(items[start:end])
        start = end
    return out
