"""What the server holds: sessions, and each model it trains (its learners, the calls
on it in the order their ``seq_id`` says, each on the model's own worker thread), checked before
anything of the model is touched: a request the caller got wrong fails alone, as a ``user`` error."""

from __future__ import annotations

import functools
import heapq
import itertools
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rltrain.config import Config
from rltrain.loss import sums
from rltrain.serve.futures import Fault, Result, outcome
from rltrain.serve.wire import BadRequest, Body, FwdBwd

# a call's place in its model's queue when it gives no seq_id (raw HTTP): before every ordered one
UNORDERED = -1
# how many of a model's recent seq_ids are remembered with their request ids (a call the SDK sends
# again, its answer lost, gets the first one's request id rather than running twice)
REMEMBERED = 1024


def say(line: str) -> None:
    """One line of the server's log, written whole (the models' threads print side by side)."""
    sys.stdout.write(f"rltrain serve: {line}\n")
    sys.stdout.flush()


def passed() -> None:
    """The call a refused request leaves in its seq_id's place: nothing runs, later calls go on."""


@dataclass
class Session:
    session_id: str
    api_key: str
    heartbeat: float = field(default_factory=time.monotonic)
    finished: bool = False


class ServedModel:
    """One trained model: its learners (a :class:`~rltrain.learner.served.ServedGroup`, started by
    :meth:`start`) and the calls on it, run one at a time in ``seq_id`` order on its own thread."""

    def __init__(self, model_id: str, session: Session, base_model: str, model_path: str, config: Config,
                 record: dict, server):  # fmt: skip
        self.model_id, self.session, self.base_model = model_id, session, base_model
        self.model_path, self.config, self.record, self.server = model_path, config, record, server
        self.vocab, self.context = server.shapes[base_model]
        self.group = None
        self.saved: tuple[Path, str, bool] | None = None  # the state a restart restores
        self.snapshots = itertools.count(1)
        self._queue: list[tuple[int, int, str | None, Callable | None]] = []
        self._order = itertools.count()
        self._done_seq = (
            0  # the start (queued first, unordered) stands for seq_id 0: the SDK's first call is 1
        )
        self._seen: dict[int, str | None] = {}  # seq_id -> its request id, the last REMEMBERED
        self._gap_since: float | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._work, daemon=True, name=f"model {model_id}")
        self._thread.start()

    def submit(self, seq_id: int | None, request_id: str | None, call: Callable | None) -> str | None:
        """Run ``call`` after every call with a lower ``seq_id`` has run (None: at once, before the
        ordered calls; ``call`` None: the thread ends there, the learners shut down; :func:`passed`:
        a refused request's place, nothing runs). The request id the call is answered under: the
        first one's, where this ``seq_id`` was received before (the SDK's retry of a call whose
        answer was lost); a ``seq_id`` that was passed over already raises :class:`BadRequest`."""
        with self._cond:
            if seq_id is not None and seq_id in self._seen:
                return self._seen[seq_id]
            if seq_id is not None and seq_id <= self._done_seq and call is not None:
                raise BadRequest(f"seq_id {seq_id} of model {self.model_id} arrived after later calls had run "
                                 f"(serve.order_timeout_s)")  # fmt: skip
            if seq_id is not None:
                self._seen[seq_id] = request_id
                while len(self._seen) > REMEMBERED:
                    del self._seen[next(iter(self._seen))]
            key = UNORDERED if seq_id is None else seq_id
            heapq.heappush(self._queue, (key, next(self._order), request_id, call))
            self._cond.notify()
        return request_id

    def _next(self) -> tuple[int, str | None, Callable | None]:
        """(Holding the lock.) The next call to run: the lowest queued, once every seq_id below it
        has run (the release, after every call, once nothing is queued before it); a gap that stays
        open ``serve.order_timeout_s`` fails the calls waiting behind it."""
        timeout = self.config.serve.order_timeout_s
        while True:
            if self._queue:
                key = self._queue[0][0]
                if key == UNORDERED or key <= self._done_seq + 1 or self._queue[0][3] is None:
                    self._gap_since = None
                    key, _, request_id, call = heapq.heappop(self._queue)
                    return key, request_id, call
                self._gap_since = self._gap_since or time.monotonic()
                if time.monotonic() - self._gap_since >= timeout:
                    self._fail_waiting(timeout)
                    continue
            self._cond.wait(None if not self._queue else 0.5)

    def _fail_waiting(self, timeout: float) -> None:
        """(Holding the lock.) The calls waiting behind a gap fail, in one sentence each; the model
        goes on after the highest of them."""
        missing, kept = self._done_seq + 1, []
        for key, order, request_id, call in self._queue:
            if call is None:
                kept.append((key, order, request_id, call))
                continue
            if call is passed:  # a refused request's place behind the gap: forgotten, not a call that waited
                continue
            self._done_seq = max(self._done_seq, key)
            if request_id is not None:
                self.server.futures.resolve(request_id, Result(
                    error=f"seq_id {key} of model {self.model_id} waited {timeout:g} s for seq_id {missing}, "
                          f"which never arrived (serve.order_timeout_s); it was not run", category="user"))  # fmt: skip
        heapq.heapify(kept)
        self._queue, self._gap_since = kept, None

    def _work(self) -> None:
        while True:
            with self._cond:
                seq_id, request_id, call = self._next()
            if call is None:
                if self.group is not None:
                    self.server.seating.leave(self.group)  # (the last model's: kept, serve.kept_learners)
                    say(f"model {self.model_id} released")
                return
            result = None if call is passed else outcome(functools.partial(self._survived, call))
            with self._cond:
                self._done_seq = max(self._done_seq, seq_id)
                self._cond.notify_all()
            if request_id is not None:
                self.server.futures.resolve(request_id, result)

    # ------------------------------------------------------------------ calls

    def _survived(self, call: Callable[[], Result]) -> Result:
        """``call()``; where a learner dies or hangs in it, the model's learners are started again
        from its last saved state (what ran after it is lost) and the call fails as the server's,
        in one sentence naming what died and what the model was restored to."""
        from rltrain.remote import ActorFailure

        seat = self.group
        if seat is not None and seat.lost:  # another model's call saw the shared learners die
            self._restore(f"{seat.lost}; this call did not run")
        generation = None if seat is None else seat.shared.generation
        try:
            return call()
        except ActorFailure as failure:
            if seat is None or failure.actor not in seat.names:
                raise  # (an engine's: the engines restart themselves)
            self.server.seating.restart(seat, generation, failure)
            self._restore(f"{failure} during this call")

    def _restore(self, what: str) -> None:
        """After the learners were started again: the model's last saved state put back (or its
        base weights), and the call fails saying so."""
        self.group.lost = None
        if self.saved is None:  # (the learners started again hold a new model's state: its base weights)
            raise Fault(f"{what}; the model's learners were restarted from its base weights (nothing was saved "
                        "with save_state): its training so far is lost") from None  # fmt: skip
        folder, path, optimizer = self.saved
        self.group.load_state(folder, optimizer)
        raise Fault(f"{what}; the model's learners were restarted from {path}, its last saved state: what ran "
                    "after it is lost") from None  # fmt: skip

    def start(self, load: tuple[str, bool] | None = None) -> Result:
        """The learners, and (``load``: a ``tinker://`` path and whether with the optimizer) the
        state saved there."""
        self.group = self.server.seating.seat(self.model_id, self.config, self.model_path)
        pids = ", ".join(str(place["pid"]) for place in self.group.where())
        say(f"model {self.model_id} ({self.base_model}) trains on the learners of pids {pids}")
        if load is None:
            return Result(json={"type": "create_model", "model_id": self.model_id})
        return self.load_state(*load)

    def forward_backward(self, call: FwdBwd) -> Result:
        from rltrain.serve.wire import forward_backward_output

        settings, datums = self._checked(call)
        logprobs, losses = self.group.forward_backward(datums, call.loss_fn, settings, call.forward_only)
        total = float(sum(float(loss.sum()) for loss in losses))
        outputs = {
            "logprobs": [lp.numpy() for lp in logprobs],
            "elementwise_loss": [x.numpy() for x in losses],
        }
        return Result(proto=forward_backward_output(outputs, {"loss:sum": total}))

    def optim_step(self, adam: dict) -> Result:
        metrics = self.group.optim_step(adam)
        return Result(json={"type": "optim_step", "metrics": {"grad_norm:mean": metrics["grad_norm"]}})

    def save_state(self, name: str, overwrite: bool) -> Result:
        folder, path = self.server.checkpoints.new(self.model_id, "weights", name, self.record, overwrite)
        self.group.save_state(folder)
        self.saved = folder, path, True  # (what a restart restores)
        return Result(json={"type": "save_weights", "path": path})

    def load_state(self, path: str, optimizer: bool) -> Result:
        folder, record = self.server.checkpoints.resolve(path, "weights", self.record["owner"])
        if (record["base_model"], record["lora_config"]) != (self.base_model, self.record["lora_config"]):
            raise BadRequest(f"{path} holds adapters of {record['base_model']} with {record['lora_config']}; "
                             f"this model trains {self.base_model} with {self.record['lora_config']}")  # fmt: skip
        self.group.load_state(folder, optimizer)
        self.saved = folder, path, optimizer
        return Result(json={"type": "load_weights", "path": path, "model_id": self.model_id})

    def save_for_sampler(self, name: str | None, overwrite: bool = True) -> Result:
        """The adapters as they are now, for sampling: the engines take them at once (a training
        step's sync); unnamed, a new sampling session on them, named also a folder of the adapter
        and (``serve.merged_exports``) the merged model."""
        from rltrain.serve.sampling import Sampler

        adapters_only = takes_adapters(self.config)
        ref = self.group.gathered_state_ref(adapters_only=adapters_only, synced=True)
        engines = self.server.engines_for(self.base_model, self.config)
        if name is None:
            key = f"{self.model_id}#{next(self.snapshots)}"
            engines.add(key, ref, load=True)
            sampler = self.server.new_sampler(
                Sampler("", self.session.api_key, self.base_model, key, None, self.session.session_id)
            )
            return Result(
                json={"type": "save_weights_for_sampler", "sampling_session_id": sampler.sampler_id}
            )
        folder, path = self.server.checkpoints.new(
            self.model_id, "sampler_weights", name, self.record, overwrite
        )
        failure = self.group.save_adapter(folder / "adapter")
        if not failure and (self.config.serve.merged_exports or not adapters_only):
            failure = self.group.save_hf(folder / "merged")
        if failure:
            raise OSError(failure)
        engines.add(path, ref, loader=weights_loader(folder, adapters_only), load=True)
        return Result(json={"type": "save_weights_for_sampler", "path": path})

    def _checked(self, call: FwdBwd):
        """The call's loss settings and datums as tensors; anything the caller got wrong raises
        :class:`BadRequest`, before the learners see it."""
        from rltrain.learner.served import Datums

        if not call.data:
            raise BadRequest("forward_backward got no datums")
        required, optional = sums.INPUTS.get(call.loss_fn, ((), ()))
        per_token = set(optional) & {k for d in call.data for k in d.inputs}
        try:
            settings = sums.settings(call.loss_fn, call.config, per_token)
        except ValueError as e:
            raise BadRequest(str(e)) from None
        tokens, targets, inputs = [], [], []
        for i, datum in enumerate(call.data):
            n = len(datum.tokens)
            if n == 0 or n > self.context:
                raise BadRequest(f"data[{i}] holds {n} tokens; the model takes 1 to {self.context}")
            given = dict(datum.inputs)
            target = given.pop("target_tokens", None)
            if target is None:
                raise BadRequest(f"data[{i}] has no loss_fn_inputs['target_tokens']")
            unknown = sorted(set(given) - set(required) - set(optional))
            missing = sorted(set(required) - set(given))
            if unknown or missing:
                raise BadRequest(f"data[{i}].loss_fn_inputs: {call.loss_fn} takes target_tokens, "
                                 f"{', '.join(required + optional)}; " + (f"missing {missing}" if missing else f"not {unknown}"))  # fmt: skip
            for name, values in [("model_input", np.asarray(datum.tokens)), ("target_tokens", target)]:
                if len(values) != n:
                    raise BadRequest(f"data[{i}].{name}: {len(values)} values for {n} tokens")
                if len(values) and (values.min() < 0 or values.max() >= self.vocab):
                    raise BadRequest(f"data[{i}].{name}: token ids outside the vocabulary of {self.vocab}")
            for name, values in given.items():
                if len(values) != n:
                    raise BadRequest(
                        f"data[{i}].loss_fn_inputs[{name!r}]: {len(values)} values for {n} tokens"
                    )
                if not np.isfinite(values).all():
                    raise BadRequest(f"data[{i}].loss_fn_inputs[{name!r}] holds NaN or inf")
            tokens.append(datum.tokens)
            targets.append(target.astype(np.int64).tolist())
            inputs.append(given)
        return settings, Datums.of(tokens, targets, inputs)


# LoRA's alpha at every rank, as Tinker's cookbook assumes (hyperparam_utils: lora_alpha=32) and
# Thinking Machines' "LoRA Without Regret" trains with: the scale 32 / rank
TINKER_ALPHA = 32.0


@functools.cache
def _structure(model_path: str, trust_remote_code: bool) -> torch.nn.Module:
    """The model at ``model_path`` on the meta device (its modules' names and shapes, no weights)."""
    from transformers import AutoConfig

    from rltrain.models.families import causal_lm_class

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return causal_lm_class(config).from_config(config, trust_remote_code=trust_remote_code)


def lora_modules(model_path: str, trust_remote_code: bool, lora: dict) -> list[str]:
    """The modules a ``lora_config`` trains on the model at ``model_path``: every linear layer of its
    attention (``train_attn``), of its MLP (``train_mlp``) and its output head (``train_unembed``), by
    this family's own names (:func:`rltrain.models.adapters.lora_targets`); what LoRA cannot reach
    (experts held as one tensor) raises :class:`BadRequest`."""
    from rltrain.models.adapters import fused_experts, lora_targets

    model = _structure(model_path, trust_remote_code)
    if lora["train_mlp"] and (fused := fused_experts(model)):
        raise BadRequest(f"lora_config train_mlp: this model's experts are held as one tensor each ({fused[0]}), "
                         "not linear layers, and LoRA on them is not served; train_mlp=False trains the rest")  # fmt: skip
    targets = lora_targets(model, lora["train_attn"], lora["train_mlp"], lora["train_unembed"])
    if not targets:
        raise BadRequest(f"lora_config: the model has no linear layer of what it asks to train ({lora})")
    return targets


def takes_adapters(config) -> bool:
    """Whether the engines take a model's LoRA adapters (vLLM serves them over the base) or its
    merged weights: vLLM has no adapters on the output head, so a model that trains it
    (``train_unembed``, the SDK's default) syncs merged weights, as a full fine-tune does."""
    model = config.model
    return head_module(model.name_or_path, model.trust_remote_code) not in model.lora.target_modules


def head_module(model_path: str, trust_remote_code: bool) -> str:
    """The name LoRA targets give the model's output head (``lm_head``, ``embed_out``, ...)."""
    from rltrain.models.adapters import lora_targets

    (head,) = lora_targets(_structure(model_path, trust_remote_code), False, False, True) or ("lm_head",)
    return head


def served_config(config: Config, model_path: str, record: dict, context: int) -> Config:
    """The learners' (and engines') config for a model of ``record``
    (:func:`~rltrain.serve.models.model_record`) on the model at ``model_path``, whose own context
    is ``context``: the server's sections, LoRA of the rank and on the modules asked for, its seed,
    and engines at the smaller of ``rollout.max_model_len`` and that context (:func:`engine_context`)."""
    lora = record["lora_config"]
    targets = lora_modules(model_path, config.model.trust_remote_code, lora)
    raw = config.model_dump()
    raw["model"]["name_or_path"] = model_path
    raw["model"]["lora"] |= {"rank": lora["rank"], "alpha": TINKER_ALPHA, "target_modules": targets}
    if lora.get("seed") is not None:
        raw["run"]["seed"] = int(lora["seed"])
    raw["rollout"]["max_model_len"] = length = engine_context(config, context)
    if (
        raw["rollout"]["max_new_tokens"] + raw["data"]["max_prompt_tokens"] > length
    ):  # (a trainer's rollouts: unused)
        raw["rollout"]["max_new_tokens"] = length // 2
        raw["data"]["max_prompt_tokens"] = length - length // 2
    raw["loss"]["kl_beta"] = 0.0
    raw["learner"] |= {"prefix_sharing": False, "optimizer": "adamw"}
    return Config.model_validate(raw)


def engine_context(config: Config, context: int) -> int:
    """The context the engines of a base model run at, and that sampling is checked against: the
    smaller of ``rollout.max_model_len`` and the model's own ``context``."""
    return min(config.rollout.max_model_len, context)


def model_shape(model_path: str, trust_remote_code: bool) -> tuple[int, int]:
    """The model's vocabulary size and context (its position embeddings)."""
    from transformers import AutoConfig

    architecture = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    text = getattr(architecture, "text_config", None) or architecture
    return int(text.vocab_size), int(getattr(text, "max_position_embeddings", None) or 1 << 30)


def model_record(body: dict) -> dict:
    """What a ``create_model`` request asks for, as the model's record (saved with each of its
    checkpoints): its base model, LoRA settings and optimizer; what is not served raises
    :class:`BadRequest`."""
    body = body if isinstance(body, Body) else Body(body, "create_model")
    optimizer = body.object("optimizer_config").text("type", "adamw")
    if optimizer != "adamw":
        raise BadRequest(f"optimizer_config {optimizer!r} is not served (AdamW is)")
    lora = body.object("lora_config")
    unknown = sorted(set(lora) - {"rank", "seed", "train_mlp", "train_attn", "train_unembed"})
    if unknown:
        raise BadRequest(
            f"lora_config {unknown} is not served (rank, seed, train_mlp, train_attn, train_unembed are)"
        )
    rank = lora.whole("rank", 0, high=1 << 16)
    if rank <= 0:
        raise BadRequest(
            "create_model needs lora_config with a rank of 1 or more (full fine-tuning is not served)"
        )
    trains = {k: lora.flag(k, True) for k in ("train_attn", "train_mlp", "train_unembed")}
    if not any(trains.values()):
        raise BadRequest("lora_config trains nothing (train_attn, train_mlp and train_unembed are all false)")
    seed = lora.whole("seed", None, low=0, high=(1 << 32) - 1)
    return {"base_model": body.text("base_model"), "optimizer": "adamw",
            "lora_config": {"rank": rank, "seed": seed, **trains}}  # fmt: skip


def adam_params(body: dict) -> dict[str, float]:
    """``optim_step``'s AdamW hyperparameters (the SDK's ``AdamParams``, its defaults where not
    sent); another optimizer family or a value out of range raises :class:`BadRequest`."""
    body = body if isinstance(body, Body) else Body(body, "optim_step")
    if body.get("adam_params") is None:
        kind = body.object("optimizer_params").get("type", "?")
        raise BadRequest(f"optim_step: the {kind} optimizer is not served (AdamW is)")
    params = body.object("adam_params")
    out = {
        "learning_rate": 1e-4,
        "beta1": 0.9,
        "beta2": 0.95,
        "eps": 1e-12,
        "weight_decay": 0.0,
        "grad_clip_norm": 0.0,
    }
    unknown = sorted(set(params) - set(out))
    if unknown:
        raise BadRequest(f"optim_step: adam_params {unknown} are not AdamW's")
    out = {k: params.number(k, v) for k, v in out.items()}
    if out["learning_rate"] < 0 or out["eps"] <= 0:
        raise BadRequest(f"optim_step: adam_params {out} (learning_rate >= 0, eps > 0)")
    if not (0 <= out["beta1"] < 1 and 0 <= out["beta2"] < 1):
        raise BadRequest(f"optim_step: beta1 and beta2 must be in [0, 1), got {out['beta1']}, {out['beta2']}")
    return out


def weights_loader(folder: Path, adapters_only: bool) -> Callable[[], object]:
    """What puts named sampler weights in the object store again (after their snapshot left the
    engines' memory, or the server restarted): the adapters, or the merged model's weights."""
    from rltrain.serve.sampling import base_loader

    return base_loader(str(folder / ("adapter" if adapters_only else "merged")))


def new_session_id() -> str:
    return f"session-{uuid.uuid4().hex[:12]}"
