"""The Tinker server's bookkeeping without learners (rltrain.serve): a model's calls strictly in
their seq_id order (a gap waits, then fails the calls behind it; a refused call's place is passed
over; a call sent twice runs once), the futures table freed, and a session that stops heartbeating
ended on time with its model and sampling sessions."""

import time
import types
from types import SimpleNamespace

import pytest

from rltrain.config import load_config
from rltrain.serve import futures as futures_module
from rltrain.serve.futures import Futures, Result
from rltrain.serve.models import ServedModel, Session, passed
from rltrain.serve.sampling import Sampler
from rltrain.serve.server import AFTER_EVERY_CALL, Server
from rltrain.serve.wire import BadRequest


def model_with(timeout: float = 30.0) -> tuple[ServedModel, Futures, list]:
    """A served model whose calls record their seq_id in ``ran`` (no learners)."""
    config = load_config("configs/cpu_tinker.yaml", [f"serve.order_timeout_s={timeout}"])
    server = types.SimpleNamespace(futures=Futures(), shapes={"base": (128, 1024)})
    model = ServedModel("m", Session("s", "key"), "base", "path", config, {}, server)
    return model, server.futures, []


def call(ran: list, seq_id: int):
    def run() -> Result:
        ran.append(seq_id)
        return Result(json={"seq_id": seq_id})

    return run


def result(futures: Futures, request_id: str, seconds: float = 10.0) -> Result | None:
    import asyncio

    return asyncio.run(futures.wait(request_id, seconds))


def test_calls_run_in_seq_id_order_a_gap_waits_and_then_fails_the_calls_behind_it():
    model, futures, ran = model_with(timeout=0.5)
    ids = {s: futures.new() for s in (3, 2, 1)}
    model.submit(3, ids[3], call(ran, 3))
    model.submit(2, ids[2], call(ran, 2))
    time.sleep(0.2)
    assert ran == []  # 2 and 3 wait for 1, however long it takes within the timeout
    model.submit(1, ids[1], call(ran, 1))
    assert result(futures, ids[3]).json == {"seq_id": 3} and ran == [1, 2, 3]
    # a refused request's place (it never reached the queue) is passed over, not waited for
    model.submit(4, None, passed)
    five = futures.new()
    model.submit(5, five, call(ran, 5))
    assert result(futures, five, 0.4).json == {"seq_id": 5}  # (within the 0.5 s a gap would wait)
    # the same seq_id again (the SDK's retry after a lost answer): the first request id, run once
    six = futures.new()
    assert model.submit(6, six, call(ran, 6)) == six
    assert model.submit(6, futures.new(), call(ran, 6)) == six
    result(futures, six)
    # a gap that stays open: the call behind it fails in one sentence after the timeout, not run
    eight = futures.new()
    start = time.monotonic()
    model.submit(8, eight, call(ran, 8))
    failed = result(futures, eight)
    assert time.monotonic() - start >= 0.5 and ran == [1, 2, 3, 5, 6]
    assert failed.error == (
        "seq_id 8 of model m waited 0.5 s for seq_id 7, which never arrived (serve.order_timeout_s); it was not run"
    )
    assert failed.category == "user"
    with pytest.raises(BadRequest, match="seq_id 7 of model m arrived after later calls had run"):
        model.submit(7, futures.new(), call(ran, 7))
    nine = futures.new()
    model.submit(9, nine, call(ran, 9))  # the model goes on after the gap
    assert result(futures, nine).json == {"seq_id": 9} and ran[-1] == 9
    # the release runs after every queued call, and the model's thread ends there
    model.submit(AFTER_EVERY_CALL, None, None)
    model._thread.join(5)
    assert not model._thread.is_alive()


def test_the_futures_table_frees_what_was_retrieved_and_what_nobody_retrieves(monkeypatch):
    monkeypatch.setattr(futures_module, "RETRIEVED_KEPT_S", 0.05)
    table = Futures(ttl_s=0.2)
    kept = []
    for _ in range(1000):  # a loop of calls, each retrieved: the table stays small
        request_id = table.new()
        table.resolve(request_id, Result(json={"big": "x" * 1000}))
        assert result(table, request_id).json is not None
        kept.append(len(table))
        if len(kept) % 100 == 0:
            time.sleep(0.06)
            table.sweep()
    assert max(kept) <= 101 and len(table) <= 1
    # a repeated poll within the minute is answered again; after it, the id is unknown
    request_id = table.new()
    table.resolve(request_id, Result(json={}))
    assert result(table, request_id) is not None and result(table, request_id) is not None
    time.sleep(0.06)
    table.sweep()
    assert not table.known(request_id)
    # a result nobody retrieves is freed after ttl_s; a pending request is never freed
    unread, pending = table.new(), table.new()
    table.resolve(unread, Result(json={}))
    table.sweep()
    assert table.known(unread)
    time.sleep(0.25)
    table.sweep()
    assert not table.known(unread) and table.known(pending)
    # a request id nobody was given keeps nothing, even when its call resolves later
    forgotten = table.new()
    table.forget(forgotten)
    table.resolve(forgotten, Result(json={}))
    assert not table.known(forgotten)


def test_a_held_poll_answers_when_its_result_arrives_and_one_whose_time_is_up_leaves_nothing_held():
    import asyncio
    import threading

    table = Futures()
    request_id = table.new()

    async def held_then_resolved() -> tuple[bool, Result | None]:
        poll = asyncio.ensure_future(table.wait(request_id, 60.0))
        await asyncio.sleep(0.1)
        answered_early = poll.done()  # (held: not answered "try again" while pending)
        threading.Thread(target=table.resolve, args=(request_id, Result(json={"x": 1}))).start()
        # woken by the result (another thread's), not at the end of its 60 s
        return answered_early, await asyncio.wait_for(poll, 10.0)

    answered_early, got = asyncio.run(held_then_resolved())
    assert not answered_early and got is not None and got.json == {"x": 1}
    pending = table.new()
    assert result(table, pending, seconds=0.05) is None  # time up: "try again"
    assert not table._waiters  # neither poll is held any longer


def test_a_session_that_stops_heartbeating_ends_on_time_with_its_model_and_samplers(
    tiny_model_path, tmp_path
):
    config = load_config(
        "configs/cpu_tinker.yaml", ["serve.session_timeout_s=0.5", f"serve.base_models=[{tiny_model_path}]"]
    )
    server = Server(config, {"base": tiny_model_path}, tmp_path)
    request = server.futures.new()  # (a result nobody retrieves: kept until serve.result_ttl_s)
    quiet, alive = Session("quiet", "key"), Session("alive", "key")
    server.sessions |= {"quiet": quiet, "alive": alive}
    released = []
    model = types.SimpleNamespace(model_id="quiet:train:0", session=quiet,
                                  submit=lambda seq_id, request_id, call: released.append((seq_id, call)))  # fmt: skip
    server.models[model.model_id] = model
    server.samplers |= {"a": Sampler("a", "key", "base", "base", None, "quiet"),
                        "b": Sampler("b", "key", "base", "base", None, "alive")}  # fmt: skip
    start = time.monotonic()
    while "quiet" in server.sessions and time.monotonic() - start < 5:
        alive.heartbeat = time.monotonic()
        time.sleep(0.05)
    # ended by the server's own sweep within ~1 s of the timeout, no create_model needed
    assert "quiet" not in server.sessions and time.monotonic() - start < 2.5
    assert released == [(AFTER_EVERY_CALL, None)] and not server.models
    assert list(server.samplers) == ["b"] and "alive" in server.sessions and "quiet" in server.ended
    assert server.futures.known(request)
    server.close()


def test_a_model_is_refused_when_its_learners_do_not_fit_beside_the_live_ones_and_the_engines():
    from rltrain.serve.server import engine_resources, learner_resources, room_problem
    from rltrain.serve.shared import groups_needed

    config = load_config("configs/cpu_tinker.yaml", [])
    one = learner_resources(config)  # 2 learners x 0.5 CPU
    assert one == {"CPU": 1.0, "GPU": 0.0} and engine_resources(config) == {"CPU": 0.5, "GPU": 0.0}
    # on 4 CPUs: the engines' 0.5 + three models' 3 = 3.5 leave 0.5, one model's learners need 1
    held = [engine_resources(config)] + [one] * 3
    problem = room_problem(one, held, {"CPU": 4.0})
    assert "take 1 CPUs" in problem and "3.5 of the cluster's 4 are held" in problem
    assert room_problem(one, held[:3], {"CPU": 4.0}) is None  # (two live models: 2.5 + 1 fit)
    gpus = learner_resources(load_config("configs/cpu_tinker.yaml", ["learner.gpus_per_learner=1"]))
    assert (
        "take 2 GPUs" in room_problem(gpus, [], {"CPU": 4.0})
        and room_problem(gpus, [], {"CPU": 4.0, "GPU": 2.0}) is None
    )
    # models alike share sets of learners (serve.models_per_learners): 3 alike and 1 of another rank
    # at 2 a set need ceil(3 / 2) + 1 = 3 sets; a fourth alike fills the second set, a fifth a new one
    other = load_config("configs/cpu_tinker.yaml", ["model.lora.rank=8"])
    assert [c.model.lora.rank for c in groups_needed([config, other, config, config], 2)] == [0, 0, 8]
    assert len(groups_needed([config] * 4 + [other], 2)) == 3 and len(groups_needed([config] * 5, 2)) == 3


def test_a_refused_request_far_ahead_never_holds_back_the_calls_below_it():
    # a request refused before it was queued (bad fields sent raw with seq_id 100) leaves its place
    # passed over; once the gap before it times out that place is forgotten, and the client's own
    # calls 1, 2, ... still run (it used to move the model past 100 and refuse them as late)
    model, futures, ran = model_with(timeout=0.3)
    model.submit(100, None, passed)
    time.sleep(0.6)
    ids = [futures.new() for _ in range(2)]
    for seq_id, request_id in zip((1, 2), ids):
        model.submit(seq_id, request_id, call(ran, seq_id))
    assert result(futures, ids[1]).json == {"seq_id": 2} and ran == [1, 2]


def test_snapshots_are_let_go_oldest_first_past_their_bytes_budget(ray_local):
    import torch

    from rltrain.serve.sampling import Engines, object_bytes

    snapshot = {"lora_A": torch.zeros(256, 1024)}  # 1 MiB of fp32
    size = object_bytes(ray_local.put(snapshot))
    assert 2**20 <= size < 2**20 + 4096  # (the tensor's bytes and a little framing)
    engines = Engines(keep=16, budget_bytes=2.5 * size)  # two fit, three do not
    for i in range(4):
        engines.add(f"m#{i}", ray_local.put(snapshot))
    assert [engines.known(f"m#{i}") for i in range(4)] == [False, False, True, True]
    assert sorted(engines.sizes) == ["m#2", "m#3"]  # (the let-go ones forgotten)
    # one larger than the whole budget still stays, alone: a client's newest weights are always held
    engines.add("big", ray_local.put({"lora_A": torch.zeros(1024, 1024)}))
    assert [k for k in ("m#2", "m#3", "big") if engines.known(k)] == ["big"]


class ToyEngine:
    """vLLM's ``LLMEngine`` as :class:`~rltrain.rollout.joined.JoinedBatch` uses it: every request
    finishes at the next step (its output names its prompt); a prompt "refused" is refused at
    ``add_request``, and a step fails where ``fail_steps`` says so."""

    def __init__(self):
        self.requests, self.aborted, self.fail_steps = {}, [], 0

    def add_request(self, request_id, prompt, params, lora_request=None):
        if prompt == "refused":
            raise ValueError("refused prompt")
        self.requests[request_id] = prompt

    def step(self):
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("the step failed")
        outputs = [SimpleNamespace(request_id=r, finished=True, prompt=p) for r, p in self.requests.items()]
        self.requests.clear()
        return outputs

    def abort_request(self, request_ids):
        self.aborted += request_ids
        for r in request_ids:
            self.requests.pop(r, None)


def test_a_joined_batch_fails_a_refused_call_alone_and_every_call_of_a_failed_step_then_goes_on():
    import threading

    from rltrain.rollout.joined import JoinedBatch

    engine, stops = ToyEngine(), []
    batch = JoinedBatch(engine, threading.RLock(), before_step=lambda: stops and stops.pop()())

    def prompts(call):
        return [out.prompt for out in batch.run([(p, None) for p in call])]

    assert prompts(["a", "b"]) == ["a", "b"]
    with pytest.raises(ValueError, match="refused prompt"):  # (its first request was added, then aborted)
        prompts(["c", "refused"])
    assert engine.aborted == ["joined-2"] and not engine.requests
    engine.fail_steps = 1
    with pytest.raises(RuntimeError, match="the step failed"):
        prompts(["d"])
    assert engine.aborted == ["joined-2", "joined-4"]  # ("joined-3" was the refused request's id)
    # the stepping thread stops (an interrupt before its second step): a call that joined after its
    # first step fails in one sentence instead of waiting for a step that never comes
    late: dict[str, object] = {}

    def second():
        try:
            late["h"] = prompts(["h"])
        except RuntimeError as error:
            late["h"] = str(error)

    thread = threading.Thread(target=second, daemon=True)

    def start_second():
        thread.start()
        while not batch._arrivals:  # (it joined: the stepping call will add it at its next step)
            time.sleep(0.001)

    def interrupt():
        raise KeyboardInterrupt

    stops.extend([interrupt, start_second])  # (popped last first)
    with pytest.raises(KeyboardInterrupt):
        prompts(["e"])
    thread.join(5)
    assert late["h"] == "the engine's sampling stopped: KeyboardInterrupt()"
    assert prompts(["f", "g"]) == ["f", "g"]  # (nothing left waiting or stepping)
