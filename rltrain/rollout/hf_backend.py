"""The in-process generation backend: transformers' ``generate``, for machines and models vLLM
does not serve (:class:`~rltrain.rollout.backends.GeneratorBackend`, the interface it shares with
the vLLM backend)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from rltrain.batch import Segment
from rltrain.config import RolloutConfig
from rltrain.loss.logprobs import Truncation, sequence_logprobs, truncation_keep
from rltrain.models import adapters
from rltrain.models.adapters import is_adapter
from rltrain.rollout.backends import _parameter_names, decode


class HFBackend:
    """transformers ``generate``: slower, for environments without vLLM."""

    def __init__(
        self, model_path: str, rc: RolloutConfig, stop: list[str], trust_remote_code: bool, lora=None
    ):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.rc, self.stop, self.lora = rc, stop, lora
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.truncation = Truncation(rc.top_k, rc.top_p, rc.min_p)
        self.tap = None
        if rc.routing_replay:  # the routes of the forward that scores the sampled tokens
            from rltrain.models.routers import RouterTap

            self.tap = RouterTap(self.model)
        if torch.cuda.is_available():
            self.model.cuda()

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], max_tokens: list[int], seeds: list[int], greedy: bool = False
    ) -> list[Segment]:
        from transformers import LogitsProcessorList

        eos = self.tokenizer.eos_token_id
        segments = []
        # sampled from the very distribution whose log-probs are reported: the temperature and
        # truncation are one processor (transformers' own warpers apply top_k, top_p and min_p in
        # another order than vLLM's)
        sampling = {"do_sample": False} if greedy else {
            "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
            "logits_processor": LogitsProcessorList([_SamplingProcessor(self.rc)])}  # fmt: skip
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
            with contextlib.nullcontext(([], [])) if self.tap is None else self.tap.capture() as (_, chosen):
                logprobs = self._logprobs(prompt + out, self.rc.temperature, self.truncation)[len(prompt) :]
            routes = torch.stack(chosen, 1)[:-1].to(torch.int16).cpu().numpy() if chosen else None
            text = decode(self.tokenizer, out)
            stopped = (out and out[-1] == eos) or any(text.endswith(s) for s in self.stop)
            finish = "stop" if stopped or len(out) < m else "length"
            segments.append(Segment(out, logprobs, text, finish, routes=routes))
        return segments

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        state = dict(named_tensors)
        if self.lora is not None and all(map(is_adapter, state)):  # a LoRA adapter, through peft
            from peft import set_peft_model_state_dict

            if not hasattr(self.model, "disable_adapter"):
                self.model = adapters.wrap(self.model, self.lora).eval()
            set_peft_model_state_dict(self.model, state)
            return
        self.model.load_state_dict(state, strict=True)

    def parameter_names(self) -> list[str]:
        return _parameter_names(self.model)

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return [self._logprobs(seq, 1.0) for seq in sequences]

    @torch.no_grad()
    def _logprobs(self, sequence: list[int], temperature: float, truncation=None) -> list[float]:
        ids = torch.tensor([sequence], device=self.model.device)
        logprobs, _ = sequence_logprobs(
            self.model, ids, torch.ones_like(ids), temperature, truncation=truncation
        )
        return logprobs[0].float().tolist()


class _SamplingProcessor:
    """transformers logits processor: logits / temperature with the truncated tokens at -inf."""

    def __init__(self, rc: RolloutConfig):
        self.temperature, self.truncation = rc.temperature, Truncation(rc.top_k, rc.top_p, rc.min_p)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        z = scores.float() / self.temperature
        if self.truncation:
            # (no target to keep: this picks the set the token is then sampled from)
            keep = truncation_keep(z, z.argmax(-1), self.truncation)
            z = z.masked_fill(~keep, float("-inf"))
        return z
