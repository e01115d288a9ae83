"""Shared set-up for the benchmark scripts: a local Ray instance and a model folder."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the CPU demo's layout (2 DeepSpeed learners + 1 vLLM engine) running plain GRPO: no tools, no warm
# start, no evaluation or checkpoints, the dense "digits" reward, one optimizer step per step
PLAIN_GRPO = [
    "algorithm.overlong=none",
    "rollout.tools.enabled=[]",
    "reward.functions={digits: 1.0}",
    "sft_warmup.steps=0",
    "run.eval_every=0",
    "run.checkpoint_every=0",
    "learner.num_mini_batches=1",
]


def scratch(prefix: str) -> Path:
    """A new folder under the system's temporary one, removed when the script exits: the runs of a
    benchmark write checkpoints of GBs that nobody reads after its figures are printed."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def mean_of(values: list[float]) -> float:
    """The mean of the values that are not NaN (a step whose samples all had one return, or a run
    without a critic); NaN when none is."""
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def rollout_paths(run: Path) -> list[Path]:
    """A run's ``rollouts/step_<N>.jsonl`` files, in step order."""
    return sorted(run.glob("rollouts/step_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))


def run_trainer(out: Path, overrides: list[str]) -> list[dict]:
    """``python -m rltrain.train`` on the demo's config with :data:`PLAIN_GRPO` and ``overrides``
    into ``out``; its metric rows, one per step."""
    done = subprocess.run(
        [sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", *PLAIN_GRPO,
         f"run.output_dir={out}", *overrides],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def start_ray(num_cpus: int = 4) -> None:
    import ray

    if not os.environ.get("RAY_ADDRESS"):
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=300 * 2**20,
            _temp_dir=str(scratch("rb")),
        )
    else:
        ray.init(log_to_driver=False)


def model_folder(model: str | None, hidden_size: int = 64, num_layers: int = 2) -> str:
    """``model`` if given (a local folder or hub name), else a freshly built tiny model."""
    if model:
        return model
    from rltrain.models.tiny import build_tiny_model

    out = scratch("rltrain-bench-") / f"tiny-{hidden_size}x{num_layers}"
    return str(build_tiny_model(out, hidden_size=hidden_size, num_layers=num_layers))


def table(header: list[str], rows: list[list[object]]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])]
    )


def serve_tinker(root: Path, out: Path, base: str, *overrides: str) -> tuple[subprocess.Popen, str]:
    """`rltrain serve` of ``root``'s checkout: the process and its URL once it listens."""
    cmd = [sys.executable, "-m", "rltrain.train", "serve", "--config", "configs/cpu_tinker.yaml", "serve.port=0",
           f"serve.base_models=[{base}]", f"run.output_dir={out}", *overrides]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root), "TINKER_TELEMETRY": "0"}
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    found: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            if "the Tinker API at http://" in line:
                found.append(re.search(r"at (http://\S+) ", line).group(1))
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(300):
        proc.kill()
        raise SystemExit("rltrain serve did not start")
    return proc, found[0]
