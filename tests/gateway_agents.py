"""Agents for tests/test_gateway.py: the official ``openai`` client against the gateway, one
function whose behaviour a data row picks (``row["mode"]``)."""

import asyncio
import json

import httpx
from openai import AsyncOpenAI

from rltrain.envs import GuessEnv, tool_schemas
from rltrain.episodes.tools import calculator

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

    if mode == "images":  # a picture, a question on it, a follow-up in text, then another picture
        first, second = row["images"]
        messages[:] = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": first}},
                                                    {"type": "text", "text": "What colour?"}]}]  # fmt: skip
        await ask()
        messages.append({"role": "user", "content": "Sure?"})
        await ask()
        messages.append({"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                                     {"type": "image_url", "image_url": {"url": second}}]})  # fmt: skip
        await ask()
        HELD[row["id"]] = messages
        return 1.0
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
    if mode == "fuzz":  # every bad request of BAD_REQUESTS, then one valid call on the same episode
        statuses = []
        async with httpx.AsyncClient(timeout=60) as http:
            key = {"Authorization": f"Bearer {api_key}"}
            for name, content, headers in bad_requests(model, api_key):
                try:
                    body = content() if callable(content) else content
                    answer = await http.post(f"{base_url}/chat/completions", content=body,
                                             headers={**key, "Content-Type": "application/json", **headers})  # fmt: skip
                    statuses.append((name, answer.status_code, answer.text))
                except httpx.TransportError as closed:  # the server may close on a huge body
                    statuses.append((name, 0, repr(closed)))
            # two valid calls at once: one is served, the other refused as concurrent (409)
            both = await asyncio.gather(*(http.post(f"{base_url}/chat/completions", headers=key,
                                                    json={"model": model, "messages": messages})
                                          for _ in range(2)))  # fmt: skip
            statuses.append(("concurrent", sorted(r.status_code for r in both), ""))
        HELD[row["id"]] = statuses
        await ask()  # the episode still serves a valid call
        return 1.0
    if mode == "huge_history":  # ~100k tokens of history, sent a few times (each refused as too long)
        history = [{"role": "user", "content": "12 + 7 = 19. " * 8000}]
        async with httpx.AsyncClient(timeout=60) as http:
            for _ in range(3):
                await http.post(f"{base_url}/chat/completions", json={"model": model, "messages": history},
                                headers={"Authorization": f"Bearer {api_key}"})  # fmt: skip
        return 0.0
    if mode == "timed":  # calls one after another while another agent sends huge histories
        await asyncio.sleep(0.3)  # (they are under way)
        seconds = []
        for _ in range(4):
            start = asyncio.get_running_loop().time()
            await client.chat.completions.create(model=model, messages=messages)
            seconds.append(asyncio.get_running_loop().time() - start)
        HELD[row["id"]] = seconds
        return 1.0
    raise ValueError(f"unknown mode {mode}")


VALID = [{"role": "user", "content": "What is 2 + 3?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c0", "type": "function",
              "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}}]},
         {"role": "tool", "tool_call_id": "c0", "content": "5"}]  # fmt: skip
# values of the wrong shape for each field the gateway reads, put where that field belongs
WRONG = {
    "messages": ["x", 5, None, {}, [], [1], [[]], ["user"]],
    "message": [5, "x", [], None],
    "role": [None, 5, "", [], {}],
    "content": [5, 1.5, {}, [1], ["x"], [{"text": "x"}], [{"type": 5}], True],
    "tool_calls": ["x", 5, ["x"], [1], [{}], [{"function": "x"}], [{"function": {}}],
                   [{"function": {"name": 5}}], [{"function": {"arguments": "{}"}}],
                   [{"function": {"name": "f", "arguments": 5}}], [{"id": 5, "function": {"name": "f"}}]],
    "tool_call_id": [5, [], {}],
    "tools": ["x", 5, [1], ["x"], [{}], [{"function": "x"}], [{"function": {"name": ""}}],
              [{"function": {"name": "f", "parameters": "x"}}], [{"type": "function", "function": None}]],
    "max_tokens": [0, -1, "x", [], 1.5],
    "sampling": [{"temperature": 0.3}, {"temperature": "hot"}, {"top_p": 2}, {"top_k": 3}, {"min_p": 0.5},
                 {"stream": True}, {"n": 3}, {"logit_bias": {"5": 100}}, {"tool_choice": "required"},
                 {"stop": ["x"]}, {"logprobs": True}, {"response_format": {"type": "json_object"}}],
}  # fmt: skip


def bad_requests(model: str, api_key: str) -> list[tuple[str, object, dict]]:
    """A few hundred requests of many kinds, each one the gateway must refuse with a 4xx (or, for a
    huge body, by closing the connection): ``(name, body or a function making its chunks, extra
    headers)``."""
    dumps = lambda body: json.dumps(body).encode()  # noqa: E731
    base = {"model": model, "messages": VALID, "tools": TOOLS}
    out = [(f"json {i}", raw, {}) for i, raw in enumerate(
        [b"", b"{", b"[1, 2]", b'"x"', b"null", b"5", b"\xff\xfe", b'{"messages": [}', b"{'a': 1}"])]  # fmt: skip
    for value in WRONG["messages"]:
        out.append(("messages", dumps({**base, "messages": value}), {}))
    for tools in (TOOLS, None):  # each message of a valid history, made wrong in each field
        with_tools = {**base, "tools": tools}
        for at in range(len(VALID)):
            for value in WRONG["message"]:
                wrong = [*VALID[:at], value, *VALID[at + 1 :]]
                out.append((f"message {at}", dumps({**with_tools, "messages": wrong}), {}))
            for field in ("role", "content", "tool_calls", "tool_call_id"):
                for value in WRONG[field]:
                    wrong = [dict(m) for m in VALID]
                    wrong[at][field] = value
                    out.append((f"{field} {at}", dumps({**with_tools, "messages": wrong}), {}))
            without_role = [dict(m) for m in VALID]
            without_role[at].pop("role")
            out.append((f"no role {at}", dumps({**with_tools, "messages": without_role}), {}))
    for value in WRONG["tools"]:
        out.append(("tools", dumps({**base, "tools": value}), {}))
    for field in ("max_tokens", "max_completion_tokens"):
        for value in WRONG["max_tokens"]:
            out.append((field, dumps({**base, field: value}), {}))
    for asks in WRONG["sampling"]:
        out.append((f"sampling {asks}", dumps({**base, **asks}), {}))
    valid = dumps({**base, "messages": VALID[:1]})
    out += [("wrong key", valid, {"Authorization": "Bearer rlt-not-this-one"}),
            ("no key", valid, {"Authorization": ""}), ("not bearer", valid, {"Authorization": api_key}),
            ("huge", b'{"messages": "' + b"x" * (17 << 20) + b'"}', {}),
            ("huge, without a length", huge_chunks, {})]  # fmt: skip
    return out


async def huge_chunks():
    """A body of 17 MB sent in chunks, without a Content-Length (the server cuts it off)."""
    yield b'{"messages": "'
    for _ in range(17):
        yield b"x" * (1 << 20)
    yield b'"}'
