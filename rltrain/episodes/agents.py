"""Running black-box agents against a generator (no ray): the gateway's HTTP server, the agents'
event loop, and the engine calls that serve them (see :mod:`rltrain.episodes.gateway`).

Three threads share a generator's process during an agent rollout:

- the server (uvicorn, started once, on the loopback address and a free port) answers
  ``/v1/chat/completions`` and ``/v1/models``; a request waits for its engine call without
  holding a thread;
- the agents run in an event loop of their own, ``agent.concurrency`` episodes at a time, each
  bounded by ``agent.timeout_s``;
- the rollout's own thread (the one that owns the engine) takes every request waiting, lets more
  arrive for a few milliseconds, and generates them in one engine call; new weights arrive between
  two calls (or, with in-flight updates, within one), so the gateway serves while weights update.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request  # (FastAPI resolves the endpoints' annotations here)
from fastapi.responses import JSONResponse

from rltrain.batch import Completion, Segment
from rltrain.episodes.chat import ChatRenderer
from rltrain.episodes.episode_state import EpisodeLimits
from rltrain.episodes.gateway import GATEWAY, Gateway, OutOfRoom, episode_completions
from rltrain.episodes.parsers import get_parser
from rltrain.episodes.requests import Refused, Sampling
from rltrain.loading import import_attribute
from rltrain.models.images import vision_inputs
from rltrain.rewards.functions import AGENT, VERIFIERS_ENV

MODEL_NAME = "rltrain-policy"  # the model the gateway serves, as /v1/models lists it
MAX_BODY_BYTES = 16 << 20
MAX_IN_FLIGHT = 4096
BATCH_WINDOW_S = 0.01  # after the first request, how long more may join the same engine call
GenerateFn = Callable[[list[list[int]], list[int], list[int]], list[Segment]]


def load_agent(spec: str) -> Callable[..., Any]:
    """``module:function`` or ``path/to/file.py:function``: ``async def run(row, base_url, api_key,
    model) -> float``; raises ValueError saying what is wrong."""
    fn = import_attribute(spec, "neither module:function nor path/to/file.py:function")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{spec!r} must be `async def run(row, base_url, api_key, model) -> float`")
    try:
        inspect.signature(fn).bind({}, "http://127.0.0.1:1/v1", "key", MODEL_NAME)
    except TypeError as e:
        raise ValueError(f"{spec!r} must take (row, base_url, api_key, model): {e}") from None
    return fn


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    seed: int
    future: Future = field(default_factory=Future)


class Batcher:
    """Requests from any thread, generated on the thread that calls :meth:`serve`."""

    def __init__(
        self, generate: GenerateFn, running: Callable[[], int] = lambda: 0, window_s: float = BATCH_WINDOW_S
    ):
        """``running()``: the agents in flight; a batch stops waiting once each has a request in it."""
        self.generate, self.running, self.window_s = generate, running, window_s
        self.queue: queue.Queue[_Request] = queue.Queue()
        self.calls = 0

    def submit(self, prompt: list[int], max_tokens: int, seed: int) -> Future:
        request = _Request(prompt, max_tokens, seed)
        self.queue.put(request)
        return request.future

    def serve(self, done: Callable[[], bool]) -> None:
        """Generate what is asked until ``done()``; an engine failure fails the waiting requests
        and is raised."""
        while True:
            try:
                batch = [self.queue.get(timeout=0.02)]
            except queue.Empty:
                if done():
                    return
                continue
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.running() and (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(self.queue.get(timeout=left))
                except queue.Empty:
                    break
            batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                segments = self.generate([r.prompt for r in batch], [r.max_tokens for r in batch],
                                         [r.seed for r in batch])  # fmt: skip
            except BaseException as e:
                for r in batch:
                    r.future.set_exception(e)
                raise
            self.calls += 1
            for r, seg in zip(batch, segments):
                r.future.set_result(seg)


def _key(request: Request) -> str | None:
    """An episode's key: the bearer token, or where a client cannot set that per episode (verifiers
    reads it from a process-wide variable) the ``X-Rltrain-Key`` header."""
    return request.headers.get("x-rltrain-key") or _bearer(request.headers.get("authorization"))


def _bearer(header: str | None) -> str | None:
    if not header or not header.lower().startswith("bearer "):
        return None
    return header[7:].strip()


async def _answer(fn, *args):
    """``fn(*args)`` off the server's loop: its response, or the HTTP error it was refused with
    (an episode that closed while its reply was sampled: counted when it closed)."""
    try:
        return await asyncio.to_thread(fn, *args)
    except Refused as r:
        return _error(r.status, r.kind, str(r))


def _error(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past ``limit`` bytes: by its Content-Length before a byte
    is read, or, without one, as soon as what arrives passes the limit."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ValueError(f"Content-Length {declared!r}")
        if int(declared) > limit:
            raise Refused(413, "too_large", f"the body is over {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise Refused(413, "too_large", f"the body is over {limit} bytes")
    return bytes(body)


class GatewayServer:
    """The gateway's HTTP server in a daemon thread, on ``127.0.0.1`` and a free port."""

    def __init__(self, runner: AgentRunner):
        import uvicorn

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        self.in_flight = 0

        @app.get("/e/{episode}/v1/models")
        async def models(episode: str, request: Request):
            try:
                runner.gateway.episode(episode, _key(request))
            except Refused as r:
                return _error(r.status, r.kind, str(r))
            return {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "rltrain"}]}

        @app.post("/e/{episode}/v1/chat/completions")
        async def chat(episode: str, request: Request):
            # the key before the body, the body's size before reading it, its shape before the
            # episode's state; rendering, tokenizing and parsing off this loop (one agent's long
            # history must not stall the others' calls); the engine's answer waited for within a bound
            key = _key(request)
            try:
                runner.gateway.episode(episode, key)
                body = await _read_body(request, MAX_BODY_BYTES)
                payload = json.loads(body)
                if not isinstance(payload, dict):
                    raise ValueError("not an object")
            except Refused as r:
                return _error(r.status, r.kind, str(r))
            except (ValueError, UnicodeDecodeError) as bad:
                return _error(400, "bad_request", f"the body is not a JSON object: {bad}")
            if self.in_flight >= MAX_IN_FLIGHT:
                return _error(503, "busy", f"{MAX_IN_FLIGHT} requests are in flight")
            try:
                e, prompt, room, seed = await asyncio.to_thread(runner.gateway.begin, episode, key, payload)
            except Refused as r:
                return _error(r.status, r.kind, str(r))
            except OutOfRoom as full:
                return await _answer(runner.gateway.out_of_room, full.episode, len(payload["messages"]))
            self.in_flight += 1
            try:
                batcher = runner.batcher
                if batcher is None:
                    raise RuntimeError("no rollout is being served")
                future = batcher.submit(prompt, room, seed)
                try:
                    seg = await asyncio.wait_for(asyncio.wrap_future(future), runner.timeout_s)
                except asyncio.TimeoutError:
                    future.cancel()
                    runner.gateway.abandon(e)
                    return _error(504, "engine_timeout", f"the engine did not answer within "
                                  f"agent.timeout_s={runner.timeout_s} s")  # fmt: skip
            except BaseException as failed:
                runner.gateway.abandon(e)
                if isinstance(failed, asyncio.CancelledError):
                    raise
                return _error(500, "engine", f"generation failed: {type(failed).__name__}: {failed}")
            finally:
                self.in_flight -= 1
            return await _answer(runner.gateway.finish, e, seg, len(payload["messages"]), len(prompt))

        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))  # the loopback only: the agents run in this process
        self.port = self.socket.getsockname()[1]
        self.root = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                limit_concurrency=MAX_IN_FLIGHT + 64)  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.socket]}, name="rltrain-gateway", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent gateway's HTTP server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


class AgentRunner:
    """A generator's agents: the gateway over their episodes, its server, and the batcher of the
    rollout in progress."""

    def __init__(self, config, tokenizer, model_path: str | None = None):
        """``model_path``: the policy's folder (a vision-language model's processor renders images)."""
        rc, agent = config.rollout, config.agent
        # the episode's function: the user's agent, or a verifiers environment's episode (whose
        # reward is the environment's, and whose rollouts run inside its serving resources)
        self.kind, self.serving, self.episodes = AGENT, contextlib.nullcontext, None
        if config.verifiers:
            from rltrain.episodes.verifiers_env import VerifiersEpisodes

            self.episodes = VerifiersEpisodes(config.env.name, config.env.kwargs, config.env.max_turns)
            self.fn, self.kind, self.serving = self.episodes.run, VERIFIERS_ENV, self.episodes.serving
        else:
            self.fn = load_agent(agent.entrypoint)
        self.timeout_s, self.concurrency = agent.timeout_s, agent.concurrency
        limits = EpisodeLimits.from_config(config)
        images = vision_inputs(config, model_path)
        self.gateway = Gateway(
            lambda tools: ChatRenderer(tokenizer, tools, config.env.render, images),
            lambda tools: get_parser(config.tool_parser, tokenizer, tools),
            limits,
            Sampling(rc.temperature, rc.top_p, rc.top_k, rc.min_p),
            MODEL_NAME,
            images is not None and not images.problem,  # (else image parts are refused, 400)
            config.data.max_image_pixels,
        )
        self.batcher: Batcher | None = None
        self.server: GatewayServer | None = None
        self.running = 0  # agents in flight (the batcher waits for no more requests than these)

    def run(self, generate: GenerateFn, rows: list[dict[str, Any]], seeds: list[int]) -> list[Completion]:
        """One episode per row, each the agent run once; generated on the calling thread."""
        if self.server is None:
            self.server = GatewayServer(self)
        self.running = 0
        self.batcher = Batcher(generate, lambda: self.running)
        results: list[Completion | None] = [None] * len(rows)
        thread = threading.Thread(
            target=lambda: asyncio.run(self._run_all(rows, seeds, results)),
            name="rltrain-agents",
            daemon=True,
        )
        thread.start()
        try:
            self.batcher.serve(done=lambda: not thread.is_alive())
        finally:
            thread.join(timeout=self.timeout_s + 30)
            self.batcher = None
        completions = [
            c if c is not None else Completion(finish_reason="error", by_agent=True) for c in results
        ]
        refused = self.take_unauthorized()  # requests no episode of this rollout could be charged with
        if refused and completions:
            completions[0].errors[f"{GATEWAY}unauthorized"] = refused
        return completions

    def base_url(self, episode) -> str:
        """An episode's endpoint: the server's, under the episode's own path."""
        assert self.server is not None
        return f"{self.server.root}/e/{episode.id}/v1"

    async def _run_all(self, rows, seeds, results) -> None:
        async with self.serving():
            await self._episodes(rows, seeds, results)
        # clients the agents left open close now, on this loop (not at garbage collection after it)
        gc.collect()
        await asyncio.sleep(0.05)

    async def _episodes(self, rows, seeds, results) -> None:
        slots = asyncio.Semaphore(self.concurrency)

        async def one(i: int) -> None:
            async with slots:
                self.running += 1
                e = self.gateway.open(rows[i], seeds[i])
                reward, metrics, error, cut = None, {}, None, False
                try:
                    run = self.fn(dict(rows[i]), self.base_url(e), e.key, MODEL_NAME)
                    value = await asyncio.wait_for(run, self.timeout_s)
                    if self.kind != AGENT:  # (a verifiers episode: its reward, its scores by name, its cut)
                        value, metrics, cut = value
                    try:
                        reward = float(value)
                    except (TypeError, ValueError):
                        raise TypeError(f"the agent returned {value!r}, not a number (its reward)") from None
                except asyncio.TimeoutError:
                    e.count_request("timeout")
                    error = (
                        self.kind,
                        f"the episode was still running after {self.timeout_s} s (agent.timeout_s)",
                    )
                except Exception:  # noqa: BLE001  (the user's code: shown, counted, never the run's end)
                    e.count_request("raised")
                    error = (self.kind, traceback.format_exc())
                finally:
                    self.gateway.close(e)
                    self.running -= 1
                results[i] = episode_completions(e, reward, error, own_reward=self.kind == AGENT, cut=cut)
                results[i].env_metrics = metrics

        await asyncio.gather(*(one(i) for i in range(len(rows))))

    def take_unauthorized(self) -> int:
        n, self.gateway.unauthorized = self.gateway.unauthorized, 0
        return n
