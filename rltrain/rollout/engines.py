"""Generator actors: vLLM engines (or transformers ``generate``) behind one small interface.

A backend turns prompts into :class:`~rltrain.batch.Segment` s and takes new weights in place;
:class:`GeneratorActor` adds tool calls on top (:func:`rltrain.rollout.tools.generate_with_tools`);
:class:`GeneratorPool` spreads requests over the engines.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import ray
import torch

from rltrain.batch import Completion, Segment
from rltrain.config import Config, RolloutConfig
from rltrain.remote import gather, where
from rltrain.rollout.episodes import Episodes
from rltrain.rollout.inflight import generate_in_chunks
from rltrain.rollout.tools import STOP, ToolRunner, generate_with_tools


class GeneratorBackend(Protocol):
    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], seeds: list[int], greedy: bool = False
    ) -> list[Segment]:
        """One segment per prompt; ``greedy`` decodes the most likely token (evaluation)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of every token given its prefix (position 0 gets 0) under the raw model
        (temperature 1: vLLM does not apply sampling parameters to prompt log-probs)."""
        ...

    def parameter_names(self) -> list[str]:
        """The engine's own parameter names, shared ones under each name (the weight sync's check)."""
        ...


# On CPU, a prompt is never split over engine steps: vLLM rewinds the per-request sampling generator
# of a partly prefilled request (`set_offset`), which CPU generators do not have, and the step fails
# ("CPU Generator does not use offset") once a batch of seeded requests outgrows one step's tokens.
# The per-step token budget then has to hold the longest prompt.
def _whole_prefills(max_model_len: int) -> dict[str, Any]:
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}


def _decode(tokenizer, token_ids: list[int]) -> str:
    """A completion's text as vLLM's incremental detokenizer ends it: an incomplete UTF-8 sequence
    at the end (decoded as U+FFFD) is held back until more tokens come, so it is left out."""
    return tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")


def _sampled_logprobs(c) -> list[float]:
    """The log-prob of each token a vLLM completion output sampled."""
    return [entry[tok].logprob for tok, entry in zip(c.token_ids, c.logprobs)]


def _finish(c) -> str:
    return "length" if c.finish_reason == "length" else "stop"


class VLLMBackend:
    def __init__(self, model_path: str, rc: RolloutConfig, stop: list[str], seed: int):
        # in-process engine: starts in seconds inside a Ray actor (its own process would need a
        # __main__ guard and ~20 s on CPU)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(rc.kv_cache_gib))))
        from vllm import LLM

        cuda = torch.cuda.is_available()
        self.rc, self.stop = rc, stop
        self.llm = LLM(
            model=model_path,
            dtype="bfloat16" if cuda else "float32",
            enforce_eager=not cuda,
            max_model_len=rc.max_model_len,
            seed=seed,
            # log-probs after temperature: the distribution the tokens were sampled from, which the
            # truncated importance-sampling correction compares against the learner
            logprobs_mode="processed_logprobs",
            **(
                {"gpu_memory_utilization": rc.gpu_memory_utilization}
                if cuda
                else _whole_prefills(rc.max_model_len)
            ),
        )
        self.tokenizer = self.llm.get_tokenizer()
        self._request_ids = itertools.count()
        # Stop strings need vLLM's incremental detokenizer. Without them (no tools) each completion is
        # decoded once at the end: vLLM would also detokenize every sampled token's log-prob entry,
        # which costs a third of the generation time of a small model on CPU.
        self._detokenize = bool(stop)
        self.stale_prefixes = False  # the prefix cache holds blocks computed under older weights

    def _params(self, greedy: bool = False, **kwargs):
        from vllm import SamplingParams

        if greedy:
            return SamplingParams(temperature=0.0, **kwargs)
        return SamplingParams(temperature=self.rc.temperature, top_p=self.rc.top_p, **kwargs)

    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], seeds: list[int], greedy: bool = False
    ) -> list[Segment]:
        params = [self._request_params(greedy, m, s) for m, s in zip(max_tokens, seeds)]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        segments = []
        for out in outputs:
            c = out.outputs[0]
            text = c.text if self._detokenize else _decode(self.tokenizer, c.token_ids)
            segments.append(Segment(list(c.token_ids), _sampled_logprobs(c), text, _finish(c)))
        return segments

    def _request_params(self, greedy: bool, max_tokens: int, seed: int):
        """A request's sampling: its seed, sampled tokens' log-probs, stop strings kept in the output."""
        return self._params(greedy, max_tokens=max_tokens, seed=seed, logprobs=0, stop=self.stop or None,
                            include_stop_str_in_output=True, detokenize=self._detokenize)  # fmt: skip

    def generate_inflight(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        seeds: list[int],
        greedy: bool,
        between_steps: Callable[[], int],
    ) -> list[Segment]:
        """:meth:`generate` driving the engine step by step: before every decode step
        ``between_steps()`` may load new weights and returns the policy version the step runs
        under, which each token it samples keeps. The requests stay in the engine throughout (their
        seeds' generators and their KV caches, computed partly under older weights, as PipelineRL
        keeps them); only their tokens from then on come from the new weights."""
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        segments: dict[str, Segment] = {}
        for prompt, m, seed in zip(prompts, max_tokens, seeds):
            params = self._request_params(greedy, m, seed)
            params.output_kind = RequestOutputKind.DELTA  # each step's new tokens only
            request_id = f"inflight-{next(self._request_ids)}"  # the outputs' name for it
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            segments[request_id] = Segment([], [], "", "length")
        try:
            while engine.has_unfinished_requests():
                version = between_steps()
                for out in engine.step():
                    seg, c = segments[out.request_id], out.outputs[0]
                    seg.token_ids += c.token_ids
                    seg.logprobs += _sampled_logprobs(c)
                    seg.versions += [version] * len(c.token_ids)
                    seg.text += c.text
                    if out.finished:
                        seg.finish_reason = _finish(c)
        except BaseException:
            engine.abort_request(list(segments))
            raise
        for seg in segments.values():
            seg.text = seg.text if self._detokenize else _decode(self.tokenizer, seg.token_ids)
        return list(segments.values())

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # in-place reload through the model's own checkpoint loader (accepts Hugging Face names);
        # cached prefixes were computed with the old weights (with requests in flight the reset
        # waits: GeneratorActor resets again before the next call)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(named_tensors), "is_checkpoint_format": True}
        )
        self.stale_prefixes = not self.llm.reset_prefix_cache()

    def parameter_names(self) -> list[str]:
        return self.llm.apply_model(_parameter_names)[0]

    def reset_stale_prefixes(self) -> None:
        if self.stale_prefixes:
            self.stale_prefixes = not self.llm.reset_prefix_cache()

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        params = self._params(max_tokens=1, prompt_logprobs=0)
        outputs = self.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
        result = []
        for seq, out in zip(sequences, outputs):
            entries = out.prompt_logprobs  # first entry is None (no prefix)
            result.append([0.0] + [entries[t][seq[t]].logprob for t in range(1, len(seq))])
        return result


class HFBackend:
    """transformers ``generate``: slower, for environments without vLLM."""

    def __init__(self, model_path: str, rc: RolloutConfig, stop: list[str], trust_remote_code: bool):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.rc, self.stop = rc, stop
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        if torch.cuda.is_available():
            self.model.cuda()

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], seeds: list[int], greedy: bool = False
    ) -> list[Segment]:
        eos = self.tokenizer.eos_token_id
        segments = []
        sampling = {"do_sample": False} if greedy else {
            "do_sample": True, "temperature": self.rc.temperature, "top_p": self.rc.top_p, "top_k": 0}  # fmt: skip
        for prompt, m, seed in zip(prompts, max_tokens, seeds):
            torch.manual_seed(seed)
            ids = torch.tensor([prompt], device=self.model.device)
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **sampling,
                max_new_tokens=m,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=eos,
                stop_strings=self.stop or None,
                tokenizer=self.tokenizer,
            )[0, len(prompt) :].tolist()
            if eos in out:
                out = out[: out.index(eos) + 1]
            logprobs = self._logprobs(prompt + out, self.rc.temperature)[len(prompt) :]
            text = _decode(self.tokenizer, out)
            stopped = (out and out[-1] == eos) or any(text.endswith(s) for s in self.stop)
            segments.append(Segment(out, logprobs, text, "stop" if stopped or len(out) < m else "length"))
        return segments

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_state_dict(dict(named_tensors), strict=True)

    def parameter_names(self) -> list[str]:
        return _parameter_names(self.model)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return [self._logprobs(seq, 1.0) for seq in sequences]

    @torch.no_grad()
    def _logprobs(self, sequence: list[int], temperature: float) -> list[float]:
        from rltrain.loss.logprobs import sequence_logprobs

        ids = torch.tensor([sequence], device=self.model.device)
        logprobs, _ = sequence_logprobs(self.model, ids, torch.ones_like(ids), temperature)
        return logprobs[0].float().tolist()


class GeneratorActor:
    """One generation engine plus the tool loop, or the episodes of an environment
    (:func:`~rltrain.rollout.episodes.run_episodes`). Created by :class:`GeneratorPool` as a Ray actor.

    It knows the policy version of its weights (the training steps behind them, sent with them)
    and stamps it on every token it samples. Without ``rollout.inflight_updates`` new weights wait
    for every rollout submitted before them, so which weights sample a step is a function of the
    run's seed; with it they are taken between two decode steps of the rollout in progress
    (:meth:`VLLMBackend.generate_inflight`) or two chunks (:mod:`rltrain.rollout.inflight`).
    """

    def __init__(self, config: Config, model_path: str, engine_index: int):
        from transformers import AutoTokenizer

        rc = config.rollout
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(
            model_path, trust_remote_code=config.model.trust_remote_code
        )
        self.tools = ToolRunner.from_config(rc.tools) if rc.tools.enabled else None
        self.stop = [STOP] if self.tools else []
        self.episodes = None
        if config.env.name is not None:
            self.episodes = Episodes(config, self.tokenizer, self.encode)
            self.stop = self.episodes.parser.stop
        if rc.backend == "vllm":
            self.backend: GeneratorBackend = VLLMBackend(
                model_path, rc, self.stop, config.run.seed + engine_index
            )
        else:
            self.backend = HFBackend(model_path, rc, self.stop, config.model.trust_remote_code)
        self.version = 0
        self._engine = threading.RLock()  # the backend runs one call at a time
        self._pending: tuple[dict[str, torch.Tensor], int] | None = None  # weights not taken yet
        self._loaded_names: list[str] = []  # of the last weights taken
        self._pending_lock = threading.Lock()
        self._busy_s, self._since = 0.0, None  # seconds in finished rollouts; the one running since

    def rollout(self, requests: list, seeds: list[int], greedy: bool = False) -> list[Completion]:
        """A completion per request: a prompt's token ids, or with an environment a data row."""
        rc = self.config.rollout
        generate = functools.partial(self.generate, greedy=greedy)
        start = self._since = time.perf_counter()
        try:
            with contextlib.nullcontext() if rc.inflight_updates else self._engine:  # else one version
                if self.episodes is not None:
                    return self.episodes.run(generate, requests, seeds)
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
        if isinstance(self.backend, VLLMBackend):  # new weights between decode steps
            with self._engine:
                self._take_weights()
                self.backend.reset_stale_prefixes()  # no request of this call reuses older weights' KV
                return self.backend.generate_inflight(prompts, max_tokens, seeds, greedy, self._between_steps)
        # otherwise between chunks, each request going on from its sampled prefix
        decode = functools.partial(_decode, self.tokenizer)
        return generate_in_chunks(
            stamped, prompts, max_tokens, seeds, rc.inflight_chunk_tokens, self.stop, decode
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
            self._pending = (state_dict, version)
        if not self.config.rollout.inflight_updates:
            with self._engine:  # waits for the rollout in progress
                self._take_weights()
        elif self._engine.acquire(blocking=False):  # idle: take them now
            try:
                self._take_weights()
            finally:
                self._engine.release()

    def _between_steps(self) -> int:
        self._take_weights()
        return self.version

    def _take_weights(self) -> None:
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self.backend.load_weights(pending[0].items())
            self.version = pending[1]
            self._loaded_names = list(pending[0])

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

    def weights_not_loaded(self) -> list[str]:
        """The engine's parameters that no name of the last weights it took loads (all of them
        before any sync)."""
        with self._engine:
            return unsent(self.backend.parameter_names(), self._loaded_names)


class GeneratorPool:
    """``rollout.num_engines`` generator actors; requests are spread evenly over them."""

    def __init__(self, config: Config, model_path: str):
        rc = config.rollout
        # in-flight weights and the busy-time probe answer beside a rollout in progress
        actor_cls = ray.remote(concurrency_groups={"weights": 1})(GeneratorActor).options(
            num_cpus=rc.cpus_per_engine, num_gpus=rc.gpus_per_engine
        )
        self.actors = [actor_cls.remote(config, model_path, i) for i in range(rc.num_engines)]
        self.names = [f"generator {i}" for i in range(rc.num_engines)]
        self.size, self.inflight = rc.num_engines, rc.inflight_updates
        self.timeout_s = config.run.actor_timeout_s
        self._submitted: dict[ray.ObjectRef, str] = {}  # in flight: which generator answers

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
        names = [self._submitted.pop(ref, "generator") for ref in refs]
        return [c for part in gather(refs, names, self.timeout_s) for c in part]

    def load_weights(self, state_ref: ray.ObjectRef, version: int) -> None:
        """Every engine takes the weights of policy ``version`` (with in-flight updates, at its
        next chunk boundary)."""
        group = "weights" if self.inflight else None  # beside the rollouts in flight, or after them
        refs = [
            a.load_weights.options(concurrency_group=group).remote(state_ref, version) for a in self.actors
        ]
        gather(refs, self.names, self.timeout_s)

    def busy_seconds(self) -> float:
        """Seconds the engines have spent generating rollouts since they started, summed."""
        return sum(gather([a.busy_seconds.remote() for a in self.actors], self.names, self.timeout_s))

    def prompt_logprobs(self, sequences: list[list[int]], every: bool = False) -> list[list[float]]:
        """The first engine's :meth:`GeneratorBackend.prompt_logprobs`; ``every``: a list of every
        engine's."""
        actors, names = (self.actors, self.names) if every else (self.actors[:1], self.names[:1])
        answers = gather([a.prompt_logprobs.remote(sequences) for a in actors], names, self.timeout_s)
        return answers if every else answers[0]

    def weights_not_loaded(self) -> list[str]:
        """The parameters of any engine that the last weights it took do not load, each named once."""
        answers = gather([a.weights_not_loaded.remote() for a in self.actors], self.names, self.timeout_s)
        return list(dict.fromkeys(name for names in answers for name in names))

    def where(self) -> list[dict[str, Any]]:
        """Node, address and pid of every generator."""
        places = gather([a.where.remote() for a in self.actors], self.names)
        return [{"actor": name, **w} for name, w in zip(self.names, places)]

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)


def _parameter_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]


# vLLM fuses these projections into one parameter, loaded from each part's checkpoint name
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip


def unsent(engine_names: list[str], sent_names: list[str]) -> list[str]:
    """The engine's parameters that no sent name loads: each sent name loads the engine parameter
    of that name, or the fused one it is part of."""
    covered = set(sent_names)
    for name in sent_names:
        module, _, leaf = name.rpartition(".")
        parent, _, part = module.rpartition(".")
        if part in FUSED:
            covered.add(f"{parent}.{FUSED[part]}.{leaf}")
    return [name for name in engine_names if name not in covered]


def _split(items: list[int], parts: int) -> list[list[int]]:
    k, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + k + (i < r)
        out.append(items[start:end])
        start = end
    return out
