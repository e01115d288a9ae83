"""Environments for the tests (imported by module path in the episodes' processes)."""

import time

from rltrain.envs import ChainEnv, Environment, Step


def wait(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "slept"


class SlowEnv(Environment):
    """A row whose answer is "hang" hangs in step; any episode may call the sleeping tool."""

    tools = [wait]

    def reset(self, row):
        self.hang = row["answer"] == "hang"
        return [{"role": "user", "content": "go"}]

    def step(self, messages):
        if self.hang:
            time.sleep(600)
        return Step(reward=1.0, done=True)


class RaisingEnv(Environment):
    def reset(self, row):
        return [{"role": "user", "content": "go"}]

    def step(self, messages):
        raise RuntimeError("the environment broke")


class RewritingTemplateEnv(Environment):
    """Opens with a user message; answers every turn (used with a history-rewriting template)."""

    def reset(self, row):
        return [{"role": "user", "content": "first"}]

    def step(self, messages):
        return Step([{"role": "user", "content": "next"}], reward=0.0)


class EchoEnv(Environment):
    """Opens with the row's prompt as the user message, whatever its length."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        return Step(reward=1.0, done=True)


class GymStepEnv(Environment):
    """Returns a gym-style tuple from step."""

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        return messages, 1.0, True, {}


class WrongStepSignatureEnv(Environment):
    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages, action):
        return Step(reward=1.0, done=True)


class StepRaisesOnWrongAnswersEnv(Environment):
    """Passes the check before the run (the row's own answer), raises on anything else."""

    def reset(self, row):
        self.answer = row["answer"]
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        if messages[-1]["content"].strip() != self.answer:
            raise KeyError("no such move")
        return Step(reward=1.0, done=True)


class TwoUsersEnv(Environment):
    """A row whose answer is "twice" answers a turn with two user messages in a row (templates that
    require alternating roles raise on it); any other row ends after its first turn."""

    def reset(self, row):
        self.twice = row["answer"] == "twice"
        return [{"role": "user", "content": "go"}]

    def step(self, messages):
        if self.twice:
            return Step([{"role": "user", "content": "one"}, {"role": "user", "content": "two"}], reward=0.0)
        return Step(reward=1.0, done=True)


class SystemChainEnv(ChainEnv):
    """The chain task opened by a system prompt (Mistral's templates move it onto the last user
    message, so the opening renders otherwise once a turn follows)."""

    SYSTEM = {"role": "system", "content": "You add and subtract with the calculator."}

    def reset(self, row):
        return [self.SYSTEM, *super().reset(row)]  # (its demonstrations open with it too)
