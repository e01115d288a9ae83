"""gather(): a dead actor is named at once (not when its blocked peers give up), a silent one after
the step timeout, and an exception inside an actor's method propagates unchanged."""

import os
import time

import pytest
import ray

from rltrain.remote import ActorFailure, gather

pytestmark = pytest.mark.slow


@ray.remote(num_cpus=0)
class Worker:
    def sleep(self, seconds: float) -> str:
        time.sleep(seconds)
        return "slept"

    def die(self) -> None:
        time.sleep(0.5)
        os._exit(1)

    def fail(self, after_s: float = 0.0) -> None:
        time.sleep(after_s)
        raise ValueError("a bad batch")


def test_a_dead_actor_is_named_while_its_peer_still_blocks(ray_local):
    blocked, dying = Worker.remote(), Worker.remote()
    start = time.monotonic()
    with pytest.raises(ActorFailure) as failure:
        gather([blocked.sleep.remote(60), dying.die.remote()], ["learner 0", "learner 1"], timeout_s=120)
    assert failure.value.actor == "learner 1" and failure.value.cause.startswith("died")
    assert time.monotonic() - start < 30  # not the peer's 60 s, nor the timeout
    ray.kill(blocked)


def test_a_peer_that_fails_after_the_named_death_adds_no_line_of_its_own(ray_local):
    # the run's last line names what died; the peer's own error, when its collective breaks a moment
    # later, is consumed rather than printed by Ray after that line as an "Unhandled error"
    import gc
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("ray._private.worker").addHandler(handler)
    try:
        peer, dying = Worker.remote(), Worker.remote()
        with pytest.raises(ActorFailure):
            gather([peer.fail.remote(2.0), dying.die.remote()], ["learner 0", "learner 1"], timeout_s=120)
        time.sleep(4.0)  # (the peer's error is in by now)
        gc.collect()
        time.sleep(1.0)
    finally:
        logging.getLogger("ray._private.worker").removeHandler(handler)
    assert not [m for m in seen if "Unhandled error" in m], seen
    ray.kill(peer)


@ray.remote(num_cpus=0)
class Unstartable:
    def __init__(self):
        raise ModuleNotFoundError("No module named 'mytaskset'")

    def ping(self) -> str:
        return "pong"


def test_an_actor_whose_start_up_raised_is_named_with_the_exception(ray_local):
    with pytest.raises(ActorFailure) as failure:
        gather([Unstartable.remote().ping.remote()], ["generator 0"], timeout_s=60)
    assert failure.value.actor == "generator 0"
    assert (
        failure.value.cause == "died (its start-up raised ModuleNotFoundError: No module named 'mytaskset')"
    )


def test_a_silent_actor_fails_after_the_timeout_and_results_keep_their_order(ray_local):
    a, b = Worker.remote(), Worker.remote()
    assert gather([a.sleep.remote(0.3), b.sleep.remote(0)], ["a", "b"], timeout_s=30) == ["slept", "slept"]
    with pytest.raises(ActorFailure, match=r"^a did not answer within run.actor_timeout_s=1s$"):
        gather([a.sleep.remote(60), b.sleep.remote(0)], ["a", "b"], timeout_s=1)
    with pytest.raises(ray.exceptions.RayTaskError, match="a bad batch"):
        gather([b.fail.remote()], ["b"], timeout_s=30)
    ray.kill(a)


class Engines:
    """What CollectiveSync._await reads of a generator pool: its actors' names, and who answers."""

    names = ["generator 0", "generator 1"]

    def silent(self, names: list[str]) -> list[str]:
        return []


def test_a_weight_sync_call_that_raised_is_named_with_its_error_before_its_blocked_peers_time_out(
    ray_local, capfd
):
    from rltrain.run.weight_sync import CollectiveSync, SyncFailed

    sync = CollectiveSync.__new__(CollectiveSync)  # (the group itself is not needed: only the waiting)
    sync.timeout_s = 60.0
    # generator 1's load raises; generator 0 and the sender wait in the collective it left
    receiver, broken, sender = Worker.remote(), Worker.remote(), Worker.remote()
    start = time.monotonic()
    with pytest.raises(SyncFailed) as failed:
        sync._await(["policy learner 0"], [sender.sleep.remote(60)], Engines(),
                    [receiver.sleep.remote(60), broken.fail.remote()], "the weight sync")  # fmt: skip
    assert str(failed.value) == "generator 1 raised ValueError: a bad batch in the weight sync"
    # named within the grace for a dead peer (5 s), not after the peers' 60 s or the time limit
    assert time.monotonic() - start < 30
    err = capfd.readouterr().err
    assert "rltrain: generator 1 raised in the weight sync:" in err  # its traceback, for the log:
    assert 'in fail\n    raise ValueError("a bad batch")' in err
    for actor in (receiver, broken, sender):
        ray.kill(actor)


def test_a_sync_that_raised_stops_the_run_in_one_line_without_a_restart(monkeypatch, tmp_path):
    from rltrain.config import load_config
    from rltrain.run import loop
    from rltrain.run.preflight import Inputs
    from rltrain.run.weight_sync import SyncFailed

    calls = []

    def raising(config, inputs):
        calls.append(1)
        raise SyncFailed("generator 1 raised KeyError: 'model.no_such.weight' in the weight sync")

    monkeypatch.setattr(loop, "train_once", raising)
    config = load_config(None, ["run.max_restarts=3", f"run.output_dir={tmp_path}"])
    inputs = Inputs(tmp_path, "unused", None, [], [], [])
    with pytest.raises(loop.RunFailed, match=r"^generator 1 raised KeyError: 'model.no_such.weight' in the "
                       r"weight sync; stopped \(not restarted: the same weights would fail the same way\)$"):  # fmt: skip
        loop.train(config, inputs)
    assert calls == [1]  # no restart: 3 were allowed
