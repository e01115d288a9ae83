"""The agent gateway's own cost per chat completion: the official ``openai`` client, the HTTP
server, the chat template's rendering, the tool parser and the batching, with an engine that
answers at once (so the figure is the gateway's alone; a real engine adds its generation time).

    python benchmarks/bench_gateway.py [--agents 1 16 64] [--calls 8]

Each agent makes ``--calls`` calls on one growing history (a reply, then a user turn), the
token-in/token-out path; rows: agents in flight at once, calls per second, milliseconds per call
(wall time over calls), and the engine calls their requests were batched into.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from common import table

from rltrain.batch import Segment
from rltrain.config import load_config
from rltrain.episodes.agents import AgentRunner
from rltrain.models.tiny import build_tokenizer
from rltrain.rollout.backends import decode

AGENT = """
from openai import AsyncOpenAI


async def run(row, base_url, api_key, model):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    for _ in range(row["calls"]):
        reply = (await client.chat.completions.create(model=model, messages=messages)).choices[0].message
        messages += [reply.model_dump(exclude_none=True), {"role": "user", "content": "And then?"}]
    return 1.0
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--agents", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--calls", type=int, default=8)
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    reply = tokenizer.encode("It is 5.", add_special_tokens=False) + [tokenizer.eos_token_id]
    batches: list[int] = []

    def engine(prompts, max_tokens, seeds):
        batches.append(len(prompts))
        return [Segment(reply, [-0.5] * len(reply), decode(tokenizer, reply), "stop", [0] * len(reply))
                for _ in prompts]  # fmt: skip

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "bench_agent.py").write_text(textwrap.dedent(AGENT))
        sys.path.insert(0, folder)
        config = load_config(None, ["agent.entrypoint=bench_agent:run", "agent.max_calls=1000",
                                    "reward.functions={agent: 1.0}", "rollout.max_new_tokens=384"])  # fmt: skip
        runner = AgentRunner(config, tokenizer)
        try:
            runner.run(engine, [{"calls": 1}], [0])  # the server is up, the client imported
            for n in args.agents:
                batches.clear()
                start = time.perf_counter()
                runner.run(engine, [{"calls": args.calls}] * n, list(range(n)))
                wall = time.perf_counter() - start
                calls = n * args.calls
                rows.append([n, f"{calls / wall:.0f}", f"{1000 * wall / calls:.2f}", len(batches)])
                print(rows[-1], flush=True)
        finally:
            runner.server.stop()
    print(table(["agents at once", "calls/s", "ms per call", "engine calls"], rows))


if __name__ == "__main__":
    main()
