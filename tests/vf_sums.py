"""A verifiers taskset for the tests (``env.name: verifiers:vf_sums``): "What is a + b?" questions,
two rewards (the exact answer, weight 1; a short reply, weight 0.5) and a metric; with
``task: {tools: true}`` the task offers a local MCP calculator (``calc_add``); the tasks listed in
``task: {broken: [...]}`` raise in their reward (the taskset's own bug); ``endless: true`` yields
tasks without end."""

import itertools
import random
import re

import verifiers.v1 as vf


class SumsData(vf.TaskData):
    answer: str = ""


class CalcToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class SumsTaskConfig(vf.TaskConfig):
    tools: bool = False
    broken: list[int] = []


def last_reply(trace: vf.Trace) -> str:
    replies = [m for m in trace.branches[-1].messages if m.role == "assistant"] if trace.branches else []
    return vf.types.content_text(replies[-1].content) if replies else ""


class SumsTask(vf.Task[SumsData, vf.State, SumsTaskConfig]):
    @classmethod
    def toolsets(cls, config: SumsTaskConfig) -> list[vf.Toolset]:
        return [CalcToolset(vf.ToolsetConfig())] if config.tools else []

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.data.idx in self.config.broken:
            raise ValueError(f"the taskset's own bug (task {self.data.idx})")
        numbers = re.findall(r"-?\d+", last_reply(trace))
        return float(bool(numbers) and numbers[-1] == self.data.answer)

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(last_reply(trace)) <= 12)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(last_reply(trace)))


class SumsConfig(vf.TasksetConfig):
    num_tasks: int = 40
    endless: bool = False  # load() yields tasks without end (num_tasks aside)
    seed: int = 0
    task: SumsTaskConfig = SumsTaskConfig()


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for _ in itertools.count() if self.config.endless else range(self.config.num_tasks):
            a, b = rng.randint(0, 20), rng.randint(0, 20)
            data = SumsData(prompt=f"What is {a} + {b}?", answer=str(a + b))
            yield SumsTask(data, self.config.task)


__all__ = ["SumsTaskset"]

if __name__ == "__main__":  # verifiers serves the toolset as `python -m vf_sums`
    CalcToolset.run()
