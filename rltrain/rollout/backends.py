"""Generation backends behind one interface (:class:`GeneratorBackend`): vLLM, and transformers'
``generate`` for machines without vLLM. A backend turns prompts into :class:`~rltrain.batch.Segment`
s, scores sequences, and takes new weights in place (by every name the sender gives); the actors
that own one are :mod:`rltrain.rollout.engines`.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from rltrain.batch import Segment, images_of
from rltrain.config import RolloutConfig
from rltrain.media import decoded
from rltrain.models.adapters import is_adapter
from rltrain.models.images import collapsed, placeholder_ids
from rltrain.rollout.joined import JoinedBatch
from rltrain.rollout.vllm_lora import AdapterFolders, lora_options, lora_slots
from rltrain.rollout.vllm_reload import Reloader


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

    def not_loaded(self, sent_names: list[str]) -> list[str]:
        """The engine's parameters (and persistent buffers) that the last weights it took, by
        ``sent_names``, wrote nothing into (all of them before any)."""
        ...


# On CPU, a prompt is never split over engine steps: vLLM rewinds the per-request sampling generator
# of a partly prefilled request (`set_offset`), which CPU generators do not have, and the step fails
# ("CPU Generator does not use offset") once a batch of seeded requests outgrows one step's tokens.
# The per-step token budget then has to hold the longest prompt.
def _cpu_options(rc: RolloutConfig) -> dict[str, Any]:
    """Whole prefills, and the KV cache in bytes (a fraction of a GiB holds; VLLM_CPU_KVCACHE_SPACE,
    whole GiB, overrides it where it is set)."""
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(rc.max_model_len, 8192),
            "kv_cache_memory_bytes": int(rc.kv_cache_gib * 2**30)}  # fmt: skip


def decode(tokenizer, token_ids: list[int]) -> str:
    """A completion's text as vLLM's incremental detokenizer ends it: an incomplete UTF-8 sequence
    at the end (decoded as U+FFFD) is held back until more tokens come, so it is left out."""
    return tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")


def _start(llm_class, **options):
    """The engine; where vLLM cannot inspect the model's module because it imports torchvision and
    torchvision is not installed (vLLM's Qwen3.5 and vision-language modules; scripts/setup_env.sh
    installs a build that loads beside torch's CPU build), one line says so."""
    import importlib.util

    try:
        return llm_class(**options)
    except Exception as error:
        if "failed to be inspected" in str(error) and importlib.util.find_spec("torchvision") is None:
            raise RuntimeError(
                f"rollout.backend=vllm: vLLM's module for {options['model']} imports torchvision, which is not "
                "installed (PyPI's torchvision wheels are CUDA builds whose ops do not load beside torch's CPU "
                "build); set rollout.backend=hf (the in-process engine)"
            ) from None
        raise


def engine_prompt(prompt: list[int]) -> dict:
    """A prompt as vLLM takes it: its token ids, and with images (an
    :class:`~rltrain.batch.ImagePrompt`) the images decoded, each placeholder collapsed to the one
    token vLLM's processor expands again (from the same processor files, to the same count)."""
    images = images_of(prompt)
    if not images:
        return {"prompt_token_ids": list(prompt)}
    return {"prompt_token_ids": collapsed(list(prompt), prompt.image_token),
            "multi_modal_data": {"image": [decoded(b) for b in images]}}  # fmt: skip


def expanded_alike(prompt: list[int], engine_ids) -> None:
    """An image prompt's placeholders as the engine expanded them must be the ones the learners
    train on: the model's processor expanded them the same way, or the run stops saying so."""
    if images_of(prompt) and list(engine_ids)[: len(prompt)] != list(prompt):
        token = prompt.image_token
        raise ValueError(
            f"vLLM's processor expanded a prompt's {len(prompt.images)} image(s) to "
            f"{list(engine_ids).count(token)} placeholder tokens, the model's processor to {list(prompt).count(token)}: "
            "the engine would sample from other inputs than the learners train on"
        )


def _sampled_logprobs(c) -> list[float]:
    """The log-prob of each token a vLLM completion output sampled."""
    return [entry[tok].logprob for tok, entry in zip(c.token_ids, c.logprobs)]


def _finish(c) -> str:
    return "length" if c.finish_reason == "length" else "stop"


def _sample_params(num_samples: int, sampling: dict, prompt_logprobs: bool):
    """A sample request's vLLM settings: its own sampling, each token's log-prob, the final output alone."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        n=num_samples, logprobs=0, prompt_logprobs=0 if prompt_logprobs else None,
        include_stop_str_in_output=True, detokenize=bool(sampling.get("stop")),
        output_kind=RequestOutputKind.FINAL_ONLY,
        **{k: v for k, v in sampling.items() if k != "stop"}, stop=sampling.get("stop") or None,
    )  # fmt: skip


def _sampled(request: tuple[list[int], int, dict, bool], out) -> tuple[list, list | None]:
    """A sample request's completions (tokens, their log-probs, why each stopped) and its prompt's
    log-probs where asked (None for the first token)."""
    prompt, _, _, prompt_logprobs = request
    sequences = [(list(c.token_ids), _sampled_logprobs(c), _finish(c)) for c in out.outputs]
    if not prompt_logprobs:
        return sequences, None
    return sequences, [None] + [out.prompt_logprobs[t][prompt[t]].logprob for t in range(1, len(prompt))]


def runs_eager(rc: RolloutConfig, cuda: bool) -> bool:
    """Whether the vLLM engine runs without CUDA graphs: on CPU (there are none), and under routing
    replay on a GPU: a replayed decode graph runs no Python, so the capture hook that records each
    step's routes (:mod:`rltrain.rollout.route_recorder`) would not run and decode positions would come
    back unrecorded. Eager decoding is slower; the routes are exact."""
    return not cuda or rc.routing_replay


def _eager_helpers() -> None:
    """On CPU the engine runs eager (:func:`runs_eager`), and so do the few sampler helpers vLLM
    wraps in ``torch.compile`` (log-prob ranks, top-k/top-p): compiled, they build C++ kernels with
    g++ at the first step on a fresh machine and load them from the cache at every later start
    (~2 s of an engine's start on 2 cores), for ops that take microseconds eager. Process-wide:
    nothing else in a generator's process compiles."""
    import torch._dynamo

    torch._dynamo.config.disable = True


class VLLMBackend:
    def __init__(self, model_path: str, rc: RolloutConfig, stop: list[str], seed: int, lora=None):
        # in-process engine: starts in seconds inside a Ray actor (its own process would need a
        # __main__ guard and ~20 s on CPU)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        cuda = torch.cuda.is_available()
        if not cuda:
            _eager_helpers()
        self.rc, self.stop = rc, stop
        self.llm = _start(
            LLM,
            model=model_path,
            dtype="bfloat16" if cuda else "float32",
            enforce_eager=runs_eager(rc, cuda),
            max_model_len=rc.max_model_len,
            seed=seed,
            # log-probs after temperature, min_p, top_k and top_p: the distribution the tokens were
            # sampled from, which the learner's log-probs reproduce (rltrain.loss.logprobs.Truncation)
            logprobs_mode="processed_logprobs",
            # routing replay: every position's routes are recorded where it runs (rltrain.rollout.route_recorder)
            **({"enable_prefix_caching": False} if rc.routing_replay else {}),
            **lora_options(lora, rc),
            **({"gpu_memory_utilization": rc.gpu_memory_utilization} if cuda else _cpu_options(rc)),
        )
        self.tokenizer = self.llm.get_tokenizer()
        # a vision-language model's placeholders are never sampled (the learners leave them out too)
        self.banned = placeholder_ids(self.llm.llm_engine.model_config.hf_config)
        self.reload = Reloader(self.llm)
        self._model_path = model_path
        self._dropped: set[str] | None = None  # sent buffers vLLM's model has no place for
        self._request_ids = itertools.count()
        self._joined: JoinedBatch | None = None  # sample calls' shared batch (made at the first)
        # Stop strings need vLLM's incremental detokenizer. Without them (no tools) each completion is
        # decoded once at the end: vLLM would also detokenize every sampled token's log-prob entry,
        # which costs a third of the generation time of a small model on CPU.
        self._detokenize = bool(stop)
        self.stale_prefixes = False  # the prefix cache holds blocks computed under older weights
        # a vision-language model's encoder cache after a reload: the reload leaves the scheduler's
        # record of it behind ("Encoder cache miss" at the next image), and older weights computed it
        self.stale_encodings = False
        self.multimodal = bool(self.banned)
        self.adapters = AdapterFolders(lora, lora_slots(rc)) if lora is not None else None
        self.recorder = None
        if rc.routing_replay:
            from rltrain.rollout.route_recorder import RouteRecorder

            self.recorder = RouteRecorder()
            self._hook_routers()

    def _hook_routers(self) -> None:
        if not self.llm.collective_rpc(self.recorder.install)[0]:
            raise RuntimeError("rollout.routing_replay: the engine's model has no MoE router to record")

    def _routes(self, request_id: str, prompt: list[int], sampled) -> Any:
        """The recorded routes of a request's positions that ran (all but its last token)."""
        if self.recorder is None:
            return None
        return self.recorder.pop(request_id, len(prompt) + len(sampled) - 1)

    def _params(self, greedy: bool = False, **kwargs):
        from vllm import SamplingParams

        if self.banned:
            kwargs["logit_bias"] = {token: float("-inf") for token in self.banned}
        if greedy:
            return SamplingParams(temperature=0.0, **kwargs)
        rc = self.rc
        return SamplingParams(
            temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k, min_p=rc.min_p, **kwargs
        )

    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], seeds: list[int], greedy: bool = False
    ) -> list[Segment]:
        self._reset_stale_encodings()
        params = [self._request_params(greedy, m, s) for m, s in zip(max_tokens, seeds)]
        outputs = self.llm.generate(
            [engine_prompt(p) for p in prompts], params, use_tqdm=False, lora_request=self.lora_request
        )
        segments = []
        for prompt, out in zip(prompts, outputs):
            expanded_alike(prompt, out.prompt_token_ids)
            c = out.outputs[0]
            text = c.text if self._detokenize else decode(self.tokenizer, c.token_ids)
            routes = self._routes(out.request_id, prompt, c.token_ids)
            segments.append(Segment(list(c.token_ids), _sampled_logprobs(c), text, _finish(c), routes=routes))
        if self.recorder is not None:
            self.recorder.clear()
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
        prompt_of: dict[str, list[int]] = {}
        for prompt, m, seed in zip(prompts, max_tokens, seeds):
            params = self._request_params(greedy, m, seed)
            params.output_kind = RequestOutputKind.DELTA  # each step's new tokens only
            request_id = f"inflight-{next(self._request_ids)}"  # the outputs' name for it
            engine.add_request(request_id, engine_prompt(prompt), params, lora_request=self.lora_request)
            segments[request_id] = Segment([], [], "", "length")
            prompt_of[request_id] = prompt
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
                        seg.routes = self._routes(out.request_id, prompt_of[out.request_id], seg.token_ids)
        except BaseException:
            engine.abort_request(list(segments))
            raise
        finally:
            if self.recorder is not None:
                self.recorder.clear()
        for seg in segments.values():
            seg.text = seg.text if self._detokenize else decode(self.tokenizer, seg.token_ids)
        return list(segments.values())

    def _known(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The sent tensors vLLM's model can take: a persistent buffer of the learners' model (they
        send the whole state) whose name vLLM's model holds nowhere, as a parameter or a buffer
        (a value vLLM folds into its kernels), is left out; every parameter goes to its loader."""
        if self._dropped is None:
            leaves = set(self.llm.apply_model(_leaf_names)[0])
            self._dropped = {
                name for name in _buffer_names(self._model_path) if name.rpartition(".")[2] not in leaves
            }
        for name, tensor in named_tensors:
            if name not in self._dropped:
                yield name, tensor

    @property
    def lora_request(self):
        """The adapter of the newest policy version (None before the first: the base, which a
        fresh adapter leaves unchanged)."""
        return None if self.adapters is None else self.adapters.request

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """In place, from any iterable (an iterator is read as its tensors arrive)."""
        if self.adapters is not None:
            named_tensors = list(named_tensors)
        if self.adapters is not None and all(is_adapter(name) for name, _ in named_tensors):
            # a LoRA adapter: served over the unchanged base from its folder; requests of older
            # versions still in flight keep theirs (each prefix is cached per adapter)
            for request in self.adapters.add(dict(named_tensors)):
                self.llm.llm_engine.remove_lora(request.lora_int_id)
            return
        # in-place reload through the model's own checkpoint loader (accepts Hugging Face names);
        # cached prefixes were computed with the old weights (with requests in flight the reset
        # waits: GeneratorActor resets again before the next call)
        self.reload(self._known(named_tensors))
        if self.recorder is not None:  # (a reload may rebuild a layer's router)
            self._hook_routers()
        self.stale_prefixes = not self.llm.reset_prefix_cache()
        self.stale_encodings = self.multimodal
        self._reset_stale_encodings()

    def not_loaded(self, sent_names: list[str]) -> list[str]:
        """vLLM's own account of the last reload (its weight loaders, :mod:`rltrain.rollout.vllm_reload`):
        the names of its model are its own (fused projections and experts, renamed layers)."""
        if self.reload.unloaded is None:
            return self.llm.apply_model(_parameter_names)[0]
        return list(self.reload.unloaded)

    def reset_stale_prefixes(self) -> None:
        if self.stale_prefixes:
            self.stale_prefixes = not self.llm.reset_prefix_cache()
        self._reset_stale_encodings()

    def _reset_stale_encodings(self) -> None:
        """Images' encodings from before the last reload go (with no request in flight: resetting
        under one desyncs the engine's caches; the next call resets then)."""
        engine = self.llm.llm_engine
        if self.stale_encodings and not engine.has_unfinished_requests():
            engine.reset_encoder_cache()
            self.stale_encodings = False

    def hold_adapter(self, adapter: int, tensors: dict[str, torch.Tensor]) -> None:
        """Serve LoRA adapters as ``adapter`` beside those held already (each sample request names
        its own; vLLM runs requests of several adapters in one batch)."""
        self.adapters.hold(adapter, dict(tensors))

    def drop_adapter(self, adapter: int) -> None:
        self.llm.llm_engine.remove_lora(self.adapters.drop(adapter))

    def sample(
        self,
        requests: list[tuple[list[int], int, dict, bool]],
        lock: threading.RLock,
        adapter: int | None = None,
    ) -> list[tuple[list, list | None]]:
        """Requests of their own, each ``(prompt, num_samples, sampling, prompt_logprobs)`` with its
        own sampling (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``
        strings, ``stop_token_ids``, ``ignore_eos``). For each: its completions' tokens, their
        log-probs and why each stopped, and the prompt's log-probs where asked (None for its first
        token). ``adapter``: a held adapter (:meth:`hold_adapter`) over the weights. Calls on other
        threads join the batch in progress at its next step (:class:`~rltrain.rollout.joined.JoinedBatch`,
        holding ``lock`` for each step); the engine's other calls (``generate``, ``prompt_logprobs``,
        new weights) run while no sample is in flight."""
        if self._joined is None:
            self._joined = JoinedBatch(self.llm.llm_engine, lock, self._reset_stale_encodings)
        entries = [(engine_prompt(prompt), _sample_params(*rest)) for prompt, *rest in requests]
        lora = self.adapters.held[adapter] if adapter is not None else self.lora_request
        return [_sampled(request, out) for request, out in zip(requests, self._joined.run(entries, lora))]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        self._reset_stale_encodings()
        params = self._params(max_tokens=1, prompt_logprobs=0)
        outputs = self.llm.generate(
            [engine_prompt(s) for s in sequences], params, use_tqdm=False, lora_request=self.lora_request
        )
        result = []
        for seq, out in zip(sequences, outputs):
            expanded_alike(seq, out.prompt_token_ids)
            entries = out.prompt_logprobs  # first entry is None (no prefix)
            result.append([0.0] + [entries[t][seq[t]].logprob for t in range(1, len(seq))])
        return result


def _buffer_names(model_path: str) -> list[str]:
    """The persistent buffers of the transformers model in ``model_path`` (built on the meta device)."""
    from transformers import AutoConfig

    from rltrain.models.families import causal_lm_class
    from rltrain.weight_transfer import state_tensors

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = causal_lm_class(config).from_config(config)
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name, _ in state_tensors(model) if name not in parameters]


def _leaf_names(model: torch.nn.Module) -> list[str]:
    """The last part of every parameter's and buffer's name (``weight``, ``e_score_correction_bias``)."""
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    return sorted({n.rpartition(".")[2] for n in names})


def _parameter_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters(remove_duplicate=False)]
