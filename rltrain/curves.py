"""``curves.png``: what people look at in a run's ``metrics.jsonl`` (held-out accuracy, reward per
function, length, entropy, KL, clipping, where the time goes, the loss; a critic's values), and the
metrics file read back (a resumed run's rows replace those it re-ran)."""

from __future__ import annotations

import json
import math
from pathlib import Path

HELD_OUT_SCORES = [("eval/accuracy", "accuracy"), ("eval/success", "success"), ("eval/reward", "reward")]


def read_metrics(path: Path) -> list[dict]:
    """Rows of metrics.jsonl; a resumed run's rows replace those it re-ran."""
    by_step: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


PANELS = [  # (title, [(metric key or key prefix, label)])
    ("held-out (greedy)", [*HELD_OUT_SCORES, ("eval/tool_call_rate", "tool-call rate")]),
    ("reward", [("reward/mean", "total")]),  # and one line per reward function (reward/<name>)
    ("response length (tokens)", [("rollout/length_mean", "mean")]),
    ("entropy", [("train/entropy", "policy")]),
    ("KL to the reference", [("train/kl", "kl")]),
    ("clip fraction", [("train/clip_fraction", "clipped")]),
    ("step time (s)", [("time/generate_s", "generate"), ("time/train_s", "train"), ("time/sync_s", "sync")]),
    ("policy loss", [("train/pg_loss", "loss")]),
]
CRITIC_PANELS = [  # drawn when the run trains a critic (algorithm.advantage: gae)
    (
        "critic: value and return (token means)",
        [("critic/value_mean", "value"), ("critic/return_mean", "return")],
    ),
    (
        "critic explained variance",
        [
            ("critic/explained_variance", "over the tokens"),
            ("critic/question_explained_variance", "at the question"),
        ],
    ),
]
NOT_FUNCTIONS = {"reward/mean", "reward/std", "reward/failures"}


def panels_for(rows: list[dict]) -> list[tuple[str, list[tuple[str, str]]]]:
    """The panels of ``curves.png``: the critic's when the run logged them."""
    return PANELS + (CRITIC_PANELS if any("critic/explained_variance" in r for r in rows) else [])


def plot_curves(metrics_path: Path, png_path: Path) -> None:
    """What people look at: held-out accuracy, reward per function, length, entropy, KL, clipping,
    where the time goes, the loss; with a critic, its values beside the returns and its explained
    variance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    if not rows:
        return
    functions = sorted({k for r in rows for k in r if k.startswith("reward/") and k not in NOT_FUNCTIONS})
    panels = panels_for(rows)
    columns = (len(panels) + 1) // 2
    fig, axes = plt.subplots(2, columns, figsize=(4 * columns, 6.5))
    for ax, (title, series) in zip(axes.flat, panels):
        if title == "reward":
            series = series + [(key, key.removeprefix("reward/")) for key in functions]
        drawn = 0
        for key, label in series:
            points = [(r["step"], r[key]) for r in rows if key in r and math.isfinite(r[key])]
            if points:
                ax.plot(*zip(*points), marker="." if len(points) < 30 else None, label=label)
                drawn += 1
        if drawn > 1:
            ax.legend(fontsize=8)
        if not drawn:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
