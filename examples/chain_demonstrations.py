"""Warm-start data for the chain agent (examples/chain_agent.py): the built-in chain task's
demonstrations on a config's training rows, written as conversations in OpenAI's chat fine-tuning
format (``{"messages": [...], "tools": [...]}`` a line, tool-call arguments as JSON strings), the
form in which an agent's own good conversations would be logged.

    python examples/chain_demonstrations.py runs/chain_demos.jsonl
    rltrain --config configs/cpu_gateway.yaml      # sft_warmup.source: runs/chain_demos.jsonl

With the config's rows and environment settings these are the conversations that
``configs/cpu_agent.yaml`` warms up on (``sft_warmup.source: env``), so the agent and the
environment start RL from the same model.
"""

import argparse
import json
from pathlib import Path

from rltrain.config import load_config
from rltrain.data import load_rows, split_held_out
from rltrain.envs import ChainEnv, tool_schemas
from rltrain.episodes.chat import with_call_ids


def openai_format(message: dict) -> dict:
    """A message as the ``openai`` client writes it: tool-call arguments as a JSON string."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {**call, "function": {**call["function"], "arguments": json.dumps(call["function"]["arguments"])}}
        for call in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the .jsonl file to write")
    parser.add_argument("--config", default="configs/cpu_agent.yaml", help="its data, eval and env.kwargs")
    parser.add_argument("--limit", type=int, help="the first LIMIT training rows only")
    args = parser.parse_args()
    config = load_config(args.config)
    rows, _ = split_held_out(load_rows(config.data), config.data, config.eval)  # never a held-out row
    rows = rows[: args.limit]
    tools = tool_schemas(ChainEnv.tools)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as f:
        for row in rows:
            messages = with_call_ids(ChainEnv(**config.env.kwargs).demonstration(row))
            f.write(json.dumps({"messages": [openai_format(m) for m in messages], "tools": tools}) + "\n")
    print(f"{len(rows)} conversations -> {args.out}")


if __name__ == "__main__":
    main()
