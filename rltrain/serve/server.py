"""The Tinker server's state, apart from its routes (:mod:`rltrain.serve.app`): sessions, the model
being trained, sampling sessions, the engines and the futures, and the sweep that ends a session
whose heartbeats stopped and frees results whose time is up."""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rltrain.config import Config
from rltrain.serve.checkpoints import Checkpoints, key_owner
from rltrain.serve.futures import Futures, Result, outcome
from rltrain.serve.models import ServedModel, Session, model_shape, served_config, takes_adapters
from rltrain.serve.sampling import Engines, Sampler, base_loader
from rltrain.serve.shared import Seating, groups_needed
from rltrain.serve.wire import BadRequest, sample_response

# the seq_id of a model's release, queued after every call a client can send (seq_ids lie below it)
AFTER_EVERY_CALL = 1 << 62
# sample requests served at once: the server's threads for them, and each engine's (each request
# joins the batch in progress); more wait for a thread
SAMPLING_THREADS = 32


def learner_resources(config: Config) -> dict[str, float]:
    """The CPUs and GPUs a model's learners take."""
    from rltrain.learner.group import resources_of

    return resources_of(config.learner)


def engine_resources(config: Config) -> dict[str, float]:
    """The CPUs and GPUs the engines take (held for sampling whether started yet or not)."""
    rc = config.rollout
    return {"CPU": rc.num_engines * rc.cpus_per_engine, "GPU": rc.num_engines * rc.gpus_per_engine}


def room_problem(need: dict[str, float], held: list[dict[str, float]], total: dict[str, float]) -> str | None:
    """Why learners taking ``need`` (CPUs, GPUs) do not fit a cluster of ``total`` of which the
    actors of ``held`` take their share; None when they fit."""
    for unit, wanted in need.items():
        taken = sum(h.get(unit, 0.0) for h in held)
        if wanted and taken + wanted > total.get(unit, 0.0) + 1e-9:
            return (f"a model's learners take {wanted:g} {unit}s (learner.num_learners x learner."
                    f"{unit.lower()}s_per_learner) and {taken:g} of the cluster's {total.get(unit, 0.0):g} "
                    "are held")  # fmt: skip
    return None


def sequence_number(value: Any, key: str) -> int | None:
    """A call's ``seq_id`` or a model's ``model_seq_id``: absent, or a non-negative integer (it
    orders the model's calls and names the model); anything else is refused before it is queued."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < AFTER_EVERY_CALL:
        raise BadRequest(f"{key} must be a non-negative integer, got {value!r}")
    return value


class Server:
    """The server's state: sessions, the models being trained, sampling sessions, the engines and
    the futures; the base models it offers (``serve.base_models`` -> local folder) and each one's
    vocabulary and context."""

    def __init__(self, config: Config, base_models: dict[str, str], output_dir: Path):
        from rltrain.learner.group import KeptLearners
        from rltrain.learner.served import ServedGroup

        self.config, self.base_models = config, base_models
        self.shapes = {
            name: model_shape(path, config.model.trust_remote_code) for name, path in base_models.items()
        }
        self.futures = Futures(config.serve.result_ttl_s)
        self.checkpoints = Checkpoints(output_dir)
        self.engines = Engines(config.serve.kept_snapshots, config.serve.snapshot_mib * 2**20)
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()  # (their heartbeats answered "finished")
        self.models: dict[str, ServedModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self.lock = threading.Lock()
        self.sampling = ThreadPoolExecutor(max_workers=SAMPLING_THREADS, thread_name_prefix="sample")
        self.kept = KeptLearners(
            config.serve.kept_learners, start=lambda c, path, _steps, _cls: ServedGroup(c, path)
        )
        self.seating = Seating(self.kept, config.serve.models_per_learners)
        self._stop = threading.Event()
        threading.Thread(target=self._sweep, daemon=True, name="sweep").start()

    def _sweep(self) -> None:
        """Every second: a session whose heartbeats stopped ``serve.session_timeout_s`` ago ends
        (its model released, its sampling sessions closed), finished sessions are forgotten, and
        results whose time is up are freed."""
        while not self._stop.wait(1.0):
            self.prune()

    def close(self) -> None:
        """The sweep stops (the process serving ends with it otherwise), the kept learners too."""
        self._stop.set()
        self.kept.close()

    def prune(self) -> None:
        timeout = self.config.serve.session_timeout_s
        with self.lock:
            for session in list(self.sessions.values()):
                if time.monotonic() - session.heartbeat > timeout:
                    session.finished = True
                if session.finished:
                    self.end(session)
        self.futures.sweep()

    def end(self, session: Session) -> None:
        """(Holding the lock.) The session's models released, its sampling sessions closed, the
        session forgotten."""
        for model in [m for m in self.models.values() if m.session is session]:
            self.release(model)
        for sampler_id in [k for k, v in self.samplers.items() if v.session_id == session.session_id]:
            del self.samplers[sampler_id]
        self.sessions.pop(session.session_id, None)
        self.ended[session.session_id] = None
        while len(self.ended) > 10_000:
            self.ended.popitem(last=False)

    def session(self, session_id: str, api_key: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.api_key != api_key:
            raise BadRequest(f"unknown session {session_id!r} for this API key")
        if session.finished:
            raise BadRequest(f"session {session_id!r} has finished")
        return session

    def model(self, model_id: str, api_key: str) -> ServedModel:
        model = self.models.get(model_id)
        if model is None:
            raise BadRequest(f"unknown model {model_id!r} (never created here, or its session ended)")
        if model.session.api_key != api_key:
            raise BadRequest(f"model {model_id!r} belongs to another session's API key")
        return model

    def sampler(self, sampler_id: str, api_key: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.api_key != api_key:
            raise BadRequest(f"unknown sampling session {sampler_id!r} for this API key")
        return sampler

    def new_sampler(self, sampler: Sampler) -> Sampler:
        sampler.sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
        self.samplers[sampler.sampler_id] = sampler
        return sampler

    def create_model(self, session: Session, base: str | None, model_seq_id, record: dict,
                     load: tuple[str, bool] | None = None) -> tuple[ServedModel, str]:  # fmt: skip
        """The model a ``create_model`` (or a ``load_weights`` that creates one) asks for, started
        on its thread: (the model, the request id of its start)."""
        model_seq_id = sequence_number(model_seq_id, "model_seq_id")  # (it becomes the model's folder)
        if base not in self.base_models:
            raise BadRequest(
                f"base_model {base!r} is not served (serve.base_models: {', '.join(self.base_models)})"
            )
        self.prune()  # (a client that stopped heartbeating frees its learners)
        with self.lock:
            record = {**record, "owner": key_owner(session.api_key)}  # (saved with its checkpoints)
            config = served_config(self.config, self.base_models[base], record, self.shapes[base][1])
            model_id = f"{session.session_id}:train:{model_seq_id or 0}"
            if model_id in self.models:
                raise BadRequest(
                    f"model_seq_id {model_seq_id or 0} of this session names the live model {model_id!r}"
                )
            self._check_room(config)
            model = ServedModel(model_id, session, base, self.base_models[base], config, record, self)
            self.models[model_id] = model
        request_id = self.futures.new()
        model.submit(None, request_id, lambda: model.start(load))
        return model, request_id

    def _check_room(self, config: Config) -> None:
        """(Holding the lock.) A new model fits: fewer than ``serve.max_models`` live, and its
        learners fit the cluster beside the live models' and the engines'
        (:func:`room_problem`); otherwise :class:`BadRequest` saying what would make room."""
        import ray

        live = list(self.models.values())
        limit = self.config.serve.max_models
        if len(live) >= limit:
            raise BadRequest(f"{len(live)} models are live, the most this server trains at once (serve.max_models="
                             f"{limit}): a session that ends releases its models")  # fmt: skip
        per, total = self.config.serve.models_per_learners, ray.cluster_resources()
        now = groups_needed([m.config for m in live], per)
        if len(groups_needed([m.config for m in live] + [config], per)) == len(now):
            return  # (it takes a seat on learners that hold models like it)
        need = learner_resources(config)
        held = [learner_resources(c) for c in now] + [engine_resources(self.config)]
        problem = room_problem(need, held, total)
        if problem:
            raise BadRequest(f"{problem} ({len(live)} live models and the engines): a session that ends "
                             "releases its models")  # fmt: skip
        # released models' learners kept started give way (the engines' share stays theirs even
        # before they start)
        while self.kept.idle and room_problem(need, held + self.kept.held(), total):
            self.kept.stop_oldest()

    def release(self, model: ServedModel) -> None:
        """The model's learners are given back after the calls already queued (kept started for a
        later model, ``serve.kept_learners``, or stopped); its saved states stay."""
        self.models.pop(model.model_id, None)
        model.submit(AFTER_EVERY_CALL, None, None)

    def engines_for(self, base: str, config: Config):
        """The engines, running for ``base`` with the LoRA layout of ``config`` (started if not)."""
        from rltrain.rollout import GeneratorPool

        if config.rollout.backend != "vllm":
            raise BadRequest(f"sampling is served by vLLM engines; this server runs rollout.backend: "
                             f"{config.rollout.backend}")  # fmt: skip
        lora, path = config.model.lora, self.base_models[base]
        adapters = takes_adapters(config)
        key = (path, lora.rank if adapters else 0, tuple(lora.target_modules) if adapters else ())
        self.engines.ensure(key, lambda: GeneratorPool(config, path, lora=adapters, sampling_threads=SAMPLING_THREADS),
                            None if adapters else base_loader(path))  # fmt: skip
        return self.engines

    def sample(self, request_id: str, sampler: Sampler, call) -> None:
        """(On a sampling thread.) The samples of one request, into its future."""

        def samples() -> Result:
            sequences, prompt = self.engines.sample(sampler.weights, call)
            return Result(proto=sample_response(sequences, call.scored(prompt)))

        self.futures.resolve(request_id, outcome(samples))
