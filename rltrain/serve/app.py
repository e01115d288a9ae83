"""``rltrain serve``: the Tinker API over HTTP, in front of rltrain's own learners (Ray actors on
DeepSpeed engines, :mod:`rltrain.learner.served`).

The SDK's calls, as it makes them: ``client/config`` (the flags it reads), ``create_session`` and
its heartbeats, ``create_model`` (LoRA adapters of the rank asked, on one of ``serve.base_models``),
``get_info``, ``forward_backward`` (protobuf), ``optim_step``, and ``retrieve_future``, which every
call that returns a request id is polled through. A request for something not served, or that the
caller got wrong, fails alone as a ``user`` error in one sentence; a request for another API key's
model is refused. The server keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rltrain.serve.checkpoints import checkpoint_name, key_owner
from rltrain.serve.futures import Result
from rltrain.serve.models import (
    ServedModel,
    Session,
    adam_params,
    engine_context,
    model_record,
    new_session_id,
    passed,
    served_config,
    takes_adapters,
    weights_loader,
)
from rltrain.serve.sampling import NOT_HELD, Sampler, sample_call
from rltrain.serve.server import Server, sequence_number
from rltrain.serve.wire import BadRequest, Body, TooLarge, forward_backward_request, json_body

# the client flags rltrain answers (the SDK's defaults for every other): plain httpx, fwd/bwd
# chunks sent in parallel and uncompressed
CLIENT_CONFIG = {"pjwt_auth_enabled": False, "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True,
                 "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False}  # fmt: skip


def api_key(request: Request) -> str:
    """The caller's key (``X-API-Key``): what a session, its models and samplers belong to."""
    given = request.headers.get("x-api-key", "")
    if not given:
        raise BadRequest("no X-API-Key header (the SDK sends TINKER_API_KEY)")
    return given


def accepted(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id}


def queued(
    server: Server, model: ServedModel, seq_id, checked: Callable[[], Callable[[], Result]]
) -> dict[str, Any]:
    """The call ``checked()`` returns, on the model's thread in ``seq_id`` order: its request id.
    A request ``checked`` refuses (:class:`BadRequest`) leaves its ``seq_id`` passed over, so the
    model's later calls do not wait for it."""
    seq_id = sequence_number(seq_id, "seq_id")
    if seq_id == 0:
        raise BadRequest("seq_id 0: a model's calls count from 1 (0 is its creation)")
    try:
        call = checked()
    except BadRequest:
        if seq_id is not None:
            with contextlib.suppress(BadRequest):
                model.submit(seq_id, None, passed)
        raise
    request_id = server.futures.new()
    answered = model.submit(seq_id, request_id, call)
    if answered != request_id:  # the same seq_id again: the first one's answer
        server.futures.forget(request_id)
        if answered is None:
            raise BadRequest(f"seq_id {seq_id} of model {model.model_id} was refused before")
    return accepted(answered, model.model_id)


def failed(error: Exception) -> JSONResponse:
    return JSONResponse({"error": str(error), "category": "user"}, status_code=getattr(error, "status", 400))


async def read(server: Server, request: Request, route: str) -> bytes:
    """The request's body, refused past ``serve.max_request_mib`` before more of it is read."""
    limit = int(server.config.serve.max_request_mib * 2**20)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise TooLarge(
            f"{route}: a body of {int(declared)} bytes, past serve.max_request_mib ({limit} bytes)"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"{route}: a body past serve.max_request_mib ({limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(server: Server, request: Request, route: str) -> Body:
    """The request's body as a JSON object (:class:`~rltrain.serve.wire.Body`)."""
    return json_body(await read(server, request, route), route)


def make_app(server: Server):
    """The FastAPI application of ``server``: the routes the SDK calls."""
    app = FastAPI(title="rltrain: the Tinker API")

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, error: BadRequest):
        return failed(error)

    @app.exception_handler(Exception)
    async def ours(request: Request, error: Exception):  # (a bug of the server's: one line, and it goes on)
        line = f"{request.url.path}: {type(error).__name__}: {error}".splitlines()[0]
        return JSONResponse({"error": line, "category": "server"}, status_code=500)

    for routes in (_service_routes, _training_routes, _weights_routes, _sampling_routes):
        routes(app, server)

    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def not_served(rest: str, request: Request):  # (after every served route)
        raise BadRequest(f"{request.method} /api/v1/{rest} is not served by rltrain serve (docs/tinker.md)")

    return app


def _service_routes(app: FastAPI, server: Server) -> None:
    """Client set-up, sessions and their heartbeats, the futures every other call is polled through."""

    @app.post("/api/v1/client/config")
    async def client_config(_request: Request):
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(_request: Request):
        return {"refresh_interval_sec": 300}

    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/api/v1/telemetry")
    async def telemetry(_request: Request):
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": name, "trainable": True, "sampleable": True}
                                     for name in server.base_models]}  # fmt: skip

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        session = Session(new_session_id(), api_key(request))
        server.sessions[session.session_id] = session
        return {"type": "create_session", "session_id": session.session_id}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        session_id = (await read_json(server, request, "session_heartbeat")).text("session_id", "")
        session = server.sessions.get(session_id)
        if session_id in server.ended or (session is not None and session.finished):
            return JSONResponse({"error": "the session has finished", "category": "user"}, status_code=410)
        server.session(session_id, api_key(request)).heartbeat = time.monotonic()
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        session = server.session(session_id, api_key(request))
        with server.lock:
            session.finished = True
            server.end(session)
        return {}

    @app.post("/api/v1/retrieve_future")
    async def retrieve(request: Request):
        body = await read_json(server, request, "retrieve_future")
        request_id = body.text("request_id", "")
        if not server.futures.known(request_id):
            raise BadRequest(f"unknown request {request_id!r} (never made here, or its result was freed: a "
                             f"minute after it was retrieved, or serve.result_ttl_s after it was ready)")  # fmt: skip
        result: Result | None = await server.futures.wait(request_id, server.config.serve.poll_s)
        if result is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"},
                                status_code=408)  # fmt: skip
        if result.failure() is not None:
            return result.failure()
        if result.proto is not None:
            return Response(result.proto, media_type="application/x-protobuf")
        return result.json


def _training_routes(app: FastAPI, server: Server) -> None:
    """The model: created, described, trained (``forward_backward``, ``optim_step``)."""

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        body = await read_json(server, request, "create_model")
        session = server.session(body.text("session_id", ""), api_key(request))
        record = model_record(body)
        model, request_id = server.create_model(
            session, body.text("base_model"), body.get("model_seq_id"), record
        )
        return accepted(request_id, model.model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        body = await read_json(server, request, "get_info")
        model = server.model(body.text("model_id", ""), api_key(request))
        lora = model.config.model.lora
        data = {"arch": model.config.model.name_or_path, "model_name": model.base_model,
                "tokenizer_id": model.model_path}  # fmt: skip
        return {"type": "get_info", "model_id": model.model_id, "model_data": data, "is_lora": True,
                "lora_rank": lora.rank, "model_name": model.base_model}  # fmt: skip

    @app.post("/api/v1/forward_backward")
    async def fwd_bwd(request: Request):
        call = forward_backward_request(await read(server, request, "forward_backward"))
        model = server.model(call.model_id, api_key(request))
        return queued(server, model, call.seq_id, lambda: lambda: model.forward_backward(call))

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        body = await read_json(server, request, "optim_step")
        model = server.model(body.text("model_id", ""), api_key(request))

        def checked():
            adam = adam_params(body)
            return lambda: model.optim_step(adam)

        return queued(server, model, body.get("seq_id"), checked)


def _weights_routes(app: FastAPI, server: Server) -> None:
    """Saved states, sampler weights and checkpoints by their ``tinker://`` paths."""

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        body = await read_json(server, request, "save_weights")
        model = server.model(body.text("model_id", ""), api_key(request))

        def checked():
            name, overwrite = body.text("path", ""), body.flag("overwrite")
            checkpoint_name(name)
            return lambda: model.save_state(name, overwrite)

        return queued(server, model, body.get("seq_id"), checked)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        body = await read_json(server, request, "load_weights")

        def wanted() -> tuple[str, bool, dict]:
            """The checkpoint asked for, checked: its path, whether with the optimizer, its record."""
            path, optimizer = body.text("path", ""), body.flag("optimizer")
            if body.text("weights_access_token"):
                raise BadRequest(
                    "load_weights: weights_access_token is not served (every checkpoint here is local)"
                )
            _, record = server.checkpoints.resolve(path, "weights", key_owner(api_key(request)))
            return path, optimizer, record

        if body.text("model_id"):  # onto a live model
            model = server.model(body.text("model_id"), api_key(request))

            def checked():
                path, optimizer, _ = wanted()
                return lambda: model.load_state(path, optimizer)

            return queued(server, model, body.get("seq_id"), checked)
        # a new model made from the checkpoint (create_training_client_from_state)
        path, optimizer, record = wanted()
        session = server.session(body.text("session_id", ""), api_key(request))
        base = body.text("base_model") or record["base_model"]
        if base != record["base_model"]:
            raise BadRequest(f"{path} holds adapters of {record['base_model']}, not of {base}")
        model, request_id = server.create_model(
            session, base, body.get("model_seq_id"), record, (path, optimizer)
        )
        return accepted(request_id, model.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request):
        body = await read_json(server, request, "save_weights_for_sampler")
        model = server.model(body.text("model_id", ""), api_key(request))

        def checked():
            if body.text("kind", "snapshot") != "snapshot":
                raise BadRequest(
                    f"save_weights_for_sampler: kind {body.get('kind')!r} is not served (snapshot is)"
                )
            name = body.text("path")
            if name is not None:
                checkpoint_name(name)
            return lambda: model.save_for_sampler(name)

        return queued(server, model, body.get("seq_id"), checked)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def checkpoints(model_id: str, request: Request):
        return {"checkpoints": server.checkpoints.listed(model_id, key_owner(api_key(request)))}


def _sampling_routes(app: FastAPI, server: Server) -> None:
    """Sampling sessions and their samples (:mod:`rltrain.serve.sampling`)."""

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        body = await read_json(server, request, "create_sampling_session")
        session = server.session(body.text("session_id", ""), api_key(request))
        path, base = body.text("model_path"), body.text("base_model")
        if path:
            folder, record = server.checkpoints.resolve(
                str(path), "sampler_weights", key_owner(session.api_key)
            )
            base = record["base_model"]
            weights = str(path)
        elif base in server.base_models:
            record, weights = None, "base"
        else:
            raise BadRequest(
                f"create_sampling_session: base_model {base!r} is not served and no model_path given"
            )
        live = next((m for m in server.models.values() if m.base_model == base), None)

        def start():  # (a thread: the engines may start first)
            if live is not None and record in (None, live.record):
                config = live.config
            else:  # (no live model of the base: the base model's weights, as a model training everything syncs them)
                made = record or model_record(
                    {"base_model": base, "lora_config": {"rank": 1, "train_mlp": False}}
                )
                config = served_config(server.config, server.base_models[base], made, server.shapes[base][1])
            engines = server.engines_for(base, config)
            if path:
                engines.add(weights, loader=weights_loader(folder, takes_adapters(config)))

        await asyncio.get_running_loop().run_in_executor(None, start)
        sampler = server.new_sampler(Sampler("", session.api_key, base, weights, path, session.session_id))
        return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        sampler = server.sampler(sampler_id, api_key(request))
        return {
            "sampler_id": sampler.sampler_id,
            "base_model": sampler.base_model,
            "model_path": sampler.model_path,
        }

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        body = await read_json(server, request, "asample")
        sampler = server.sampler(body.text("sampling_session_id", ""), api_key(request))
        if (
            server.engines.pool_key is None
            or server.engines.pool_key[0] != server.base_models[sampler.base_model]
        ):
            raise BadRequest(f"the engines serve another base model now; sampling session {sampler.sampler_id!r} "
                             f"was for {sampler.base_model}")  # fmt: skip
        if not server.engines.known(sampler.weights):
            raise BadRequest(NOT_HELD)
        vocab, context = server.shapes[sampler.base_model]
        call = sample_call(body, vocab, engine_context(server.config, context))
        request_id = server.futures.new()
        server.sampling.submit(server.sample, request_id, sampler, call)
        return {
            "request_id": request_id,
            "sample_sequence_ids": [uuid.uuid4().hex for _ in range(call.num_samples)],
        }
