"""Metrics a user can watch: a progress bar with a one-line summary per step, JSONL, TensorBoard,
optional Weights & Biases, and a PNG of the reward and loss curves at the end."""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm import tqdm

from rltrain.config import Config

SUMMARY = [
    ("reward", "reward/mean", "{:.3f}"),
    ("loss", "train/pg_loss", "{:+.4f}"),
    ("kl", "train/kl", "{:.4f}"),
    ("tok/s", "perf/tokens_per_s", "{:.0f}"),
    ("gen", "time/generate_s", "{:.2f}s"),
    ("train", "time/train_s", "{:.2f}s"),
    ("sync", "time/sync_s", "{:.2f}s"),
]


class Tracker:
    def __init__(self, out_dir: Path, config: Config, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.out_dir, self.total = out_dir, config.run.steps
        # a resumed run re-runs the steps after its checkpoint: their old rows go, in every log
        truncate_metrics(out_dir / "metrics.jsonl", start_step)
        self.jsonl = (out_dir / "metrics.jsonl").open("a")
        self.tensorboard = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step + 1)
        self.wandb = None
        if config.run.wandb_project:
            import wandb

            self.wandb = wandb.init(
                project=config.run.wandb_project,
                config=config.model_dump(mode="json"),
                dir=str(out_dir),
                resume="allow",
            )
        self.bar = tqdm(
            total=config.run.steps, initial=start_step, desc="training", unit="step", dynamic_ncols=True
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        for key, value in metrics.items():
            self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        parts = [f"{name} {fmt.format(metrics[key])}" for name, key, fmt in SUMMARY if key in metrics]
        self.bar.write(f"step {step}/{self.total} " + " ".join(parts))
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.jsonl.close()
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        plot_curves(self.out_dir / "metrics.jsonl", self.out_dir / "curves.png")


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the rows of steps up to ``last_step`` (atomically: a crash leaves the old file or the new)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= last_step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


def read_metrics(path: Path) -> list[dict]:
    """Rows of metrics.jsonl; a resumed run's rows replace those it re-ran."""
    by_step: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, key, title in [
        (axes[0], "reward/mean", "mean reward"),
        (axes[1], "train/pg_loss", "policy loss"),
    ]:
        points = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
        if points:
            ax.plot(*zip(*points), marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
