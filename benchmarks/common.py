"""Shared set-up for the benchmark scripts: a local Ray instance and a model folder."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def start_ray(num_cpus: int = 4) -> None:
    import ray

    if not os.environ.get("RAY_ADDRESS"):
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=300 * 2**20,
            _temp_dir=tempfile.mkdtemp(prefix="rb", dir="/tmp"),
        )
    else:
        ray.init(log_to_driver=False)


def model_folder(model: str | None, hidden_size: int = 64, num_layers: int = 2) -> str:
    """``model`` if given (a local folder or hub name), else a freshly built tiny model."""
    if model:
        return model
    from rltrain.tiny_model import build_tiny_model

    out = Path(tempfile.mkdtemp(prefix="rltrain-bench-")) / f"tiny-{hidden_size}x{num_layers}"
    return str(build_tiny_model(out, hidden_size=hidden_size, num_layers=num_layers))


def table(header: list[str], rows: list[list[object]]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join(
        [line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])]
    )
