"""Agents for tests/test_gateway.py: the official ``openai`` client against the gateway, one
function whose behaviour a data row picks (``row["mode"]``)."""

import asyncio
import json

import httpx
from openai import AsyncOpenAI

from rltrain.envs import GuessEnv, tool_schemas
from rltrain.rollout.tools import calculator

TOOLS = tool_schemas([calculator])
SEEN: dict[str, tuple[str, str]] = {}  # row id -> (base_url, api_key) of a finished episode
HELD: dict[str, object] = {}  # row id -> what the agent held at its end (its messages, statuses)


async def run(row: dict, base_url: str, api_key: str, model: str) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    mode = row["mode"]
    messages = [{"role": "user", "content": row.get("prompt", "What is 2 + 3?")}]

    async def ask(**kwargs):
        reply = (
            (await client.chat.completions.create(model=model, messages=messages, **kwargs))
            .choices[0]
            .message
        )
        messages.append(reply.model_dump(exclude_none=True))
        return reply

    if mode == "tool_loop":  # call, run the tool, call again, until an answer
        for _ in range(3):
            reply = await ask(tools=TOOLS)
            if not reply.tool_calls:
                break
            for call in reply.tool_calls:
                result = calculator(**json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        HELD[row["id"]] = messages
        return 1.0
    if mode == "rewrite":  # two calls on one history, then a summary in its place
        await ask()
        messages.append({"role": "user", "content": "Go on."})
        await ask()
        messages[:] = [
            {"role": "user", "content": "Summary: we spoke of 2 + 3."},
            {"role": "user", "content": "So?"},
        ]
        await ask()
        return 0.5
    if mode == "guess":  # builtin:guess as a black-box agent; "rewrite" rows restate the history once
        env = GuessEnv()
        messages[:] = env.reset(row)
        for turn in range(3):
            await ask()
            step = env.step(messages)
            if step.done:
                return step.reward or 0.0
            if row.get("rewrite") and turn == 0:  # the agent summarises: a new training sequence
                messages[:] = [{"role": "user", "content": f"Guess 1-15, not {messages[-1]['content'][:6]}"}]
            messages.extend(step.messages)
        return 0.0
    if mode == "twice":  # a reply, a user turn, another reply, on one history
        await ask()
        messages.append({"role": "user", "content": "And then?"})
        await ask()
        return 1.0
    if mode == "once":
        await ask()
        return float(row.get("reward", 1.0))
    if mode == "hang":
        await ask()
        await asyncio.sleep(3600)
    if mode == "raise":
        await ask()
        raise ValueError("the agent's own bug")
    if mode == "finished":  # an episode that ends at once, its endpoint and key kept for "intruder"
        SEEN[row["id"]] = (base_url, api_key)
        return 0.0
    if mode == "intruder":  # every other way in: each must be refused with 401
        while row["target"] not in SEEN:
            await asyncio.sleep(0.01)
        other_url, other_key = SEEN[row["target"]]
        statuses = []
        async with httpx.AsyncClient() as http:
            body = {"model": model, "messages": messages}
            for url, headers in [
                (other_url, {"Authorization": f"Bearer {other_key}"}),  # a finished episode's
                (base_url, {"Authorization": f"Bearer {other_key}"}),  # another episode's key
                (base_url, {}),  # no key
                (other_url, {"Authorization": f"Bearer {api_key}"}),  # its key on another's endpoint
            ]:
                statuses.append(
                    (await http.post(f"{url}/chat/completions", json=body, headers=headers)).status_code
                )
            sampled = await http.post(f"{base_url}/chat/completions", json={**body, "temperature": 0.3},
                                      headers={"Authorization": f"Bearer {api_key}"})  # fmt: skip
            statuses.append(sampled.status_code)
        HELD[row["id"]] = statuses
        await ask()  # its own key on its own endpoint works
        return 1.0
    raise ValueError(f"unknown mode {mode}")
