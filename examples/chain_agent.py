"""The built-in chain task (``env.name: builtin:chain``) written as a black-box agent: a plain
``openai`` client loop that calls the calculator itself. rltrain trains the model behind it through
its gateway, with nothing in the agent but where it reads its endpoint:

    python examples/chain_demonstrations.py runs/chain_demos.jsonl   # its warm start's data
    rltrain --config configs/cpu_gateway.yaml

The task is the one ``configs/cpu_agent.yaml`` sets as an environment (``env.kwargs``): two links,
numbers up to 300.
"""

import json

from openai import AsyncOpenAI

from rltrain.envs import ChainEnv, tool_schemas
from rltrain.episodes.tools import calculator

TOOLS = tool_schemas([calculator])
TASK = {"links": 2, "high": 300}  # as configs/cpu_agent.yaml sets the environment (env.kwargs)


async def run(row: dict, base_url: str, api_key: str, model: str) -> float:
    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        return await chain(client, row, model)


async def chain(client: AsyncOpenAI, row: dict, model: str) -> float:
    task = ChainEnv(**TASK)  # the task's questions, answers and reward
    messages = task.reset(row)
    for _ in range(6):
        response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        reply = response.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        for call in reply.tool_calls or []:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as e:  # noqa: BLE001  (the model's bad call: it reads the error)
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if reply.tool_calls:
            continue
        step = task.step(messages)
        if step.done:
            return step.reward or 0.0
        messages += step.messages
    return 0.0
