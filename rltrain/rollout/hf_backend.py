"""The in-process generation backend: transformers' ``generate``, for machines and models vLLM
does not serve (:class:`~rltrain.rollout.backends.GeneratorBackend`, the interface it shares with
the vLLM backend)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from rltrain import weight_transfer
from rltrain.batch import Segment, images_of
from rltrain.config import RolloutConfig
from rltrain.forward import sequence_logprobs
from rltrain.loss.logprobs import Truncation, truncation_keep
from rltrain.models import adapters
from rltrain.models.adapters import is_adapter
from rltrain.models.families import causal_lm_class
from rltrain.models.images import ImageInputs, is_vision_parameter, placeholder_ids
from rltrain.rollout.backends import decode


class HFBackend:
    """transformers ``generate``: slower, for environments without vLLM."""

    def __init__(
        self, model_path: str, rc: RolloutConfig, stop: list[str], trust_remote_code: bool, lora=None
    ):
        from transformers import AutoConfig, AutoTokenizer

        self.rc, self.stop, self.lora = rc, stop, lora
        self.tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.model = causal_lm_class(config).from_pretrained(model_path, dtype=dtype).eval()
        # a vision-language model's placeholders are never sampled (the learners leave them out too)
        self.truncation = Truncation(rc.top_k, rc.top_p, rc.min_p, placeholder_ids(config))
        self.images = ImageInputs(model_path, trust_remote_code)  # (its processor loads at first use)
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
        processor = LogitsProcessorList([_SamplingProcessor(self.rc.temperature, self.truncation)])
        sampling = {
            "do_sample": True,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "logits_processor": processor,
        }
        if greedy:
            banned = Truncation(banned=self.truncation.banned)
            sampling = {
                "do_sample": False,
                "logits_processor": LogitsProcessorList([_SamplingProcessor(1.0, banned)]),
            }
        for prompt, m, seed in zip(prompts, max_tokens, seeds):
            torch.manual_seed(seed)
            ids = torch.tensor([list(prompt)], device=self.model.device)
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                **self._image_inputs(prompt, ids),
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
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        # every weight, but a frozen vision side the learners leave out of syncs (model.freeze_vision)
        if unexpected or [name for name in missing if not is_vision_parameter(name)]:
            raise RuntimeError(f"weights that do not fit the engine's model: unexpected {unexpected[:5]}, "
                               f"missing {[n for n in missing if not is_vision_parameter(n)][:5]}")  # fmt: skip

    def not_loaded(self, sent_names: list[str]) -> list[str]:
        sent = set(sent_names)
        return [name for name, _ in weight_transfer.state_tensors(self.model) if name not in sent]

    def prompt_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        return [self._logprobs(seq, 1.0) for seq in sequences]

    def _image_inputs(self, prompt: list[int], ids: torch.Tensor) -> dict:
        """What ``generate`` takes with an image prompt's ids: its images' patches and grids, and
        which tokens are placeholders (without them the model would give every token text positions)."""
        images = images_of(prompt)
        if not images:
            return {}
        found = self.images(images).to(self.model.device)
        types = (ids == prompt.image_token).int()
        return {"pixel_values": found.pixel_values, "image_grid_thw": found.grid_thw.to(ids.device),
                "mm_token_type_ids": types}  # fmt: skip

    @torch.no_grad()
    def _logprobs(self, sequence: list[int], temperature: float, truncation=None) -> list[float]:
        ids = torch.tensor([list(sequence)], device=self.model.device)
        images = images_of(sequence)
        logprobs, _ = sequence_logprobs(
            self.model, ids, torch.ones_like(ids), temperature, truncation=truncation,
            images=[self.images(images).to(self.model.device)] if images else None,
        )  # fmt: skip
        return logprobs[0].float().tolist()


class _SamplingProcessor:
    """transformers logits processor: logits / temperature with the truncated tokens at -inf."""

    def __init__(self, temperature: float, truncation: Truncation):
        self.temperature, self.truncation = temperature, truncation

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        z = scores.float() / self.temperature
        if self.truncation.banned:
            z[:, list(self.truncation.banned)] = float("-inf")
        if self.truncation:
            # (no target to keep: this picks the set the token is then sampled from; the most
            # likely one is kept anyway)
            keep = truncation_keep(z, z.argmax(-1), self.truncation)
            z = z.masked_fill(~keep, float("-inf"))
        return z
