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

    def fail(self) -> None:
        raise ValueError("a bad batch")


def test_a_dead_actor_is_named_while_its_peer_still_blocks(ray_local):
    blocked, dying = Worker.remote(), Worker.remote()
    start = time.monotonic()
    with pytest.raises(ActorFailure) as failure:
        gather([blocked.sleep.remote(60), dying.die.remote()], ["learner 0", "learner 1"], timeout_s=120)
    assert failure.value.actor == "learner 1" and failure.value.cause.startswith("died")
    assert time.monotonic() - start < 30  # not the peer's 60 s, nor the timeout
    ray.kill(blocked)


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
