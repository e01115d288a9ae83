"""Metrics a user can watch: a progress bar with a one-line summary per step, JSONL, TensorBoard,
optional Weights & Biases and trackio, and a PNG of the reward and loss curves at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tqdm import tqdm

from rltrain.batch import images_of
from rltrain.config import Config
from rltrain.curves import HELD_OUT_SCORES, plot_curves, read_metrics
from rltrain.media import described
from rltrain.rewards.functions import reward_name

# failures/ counts of samples (rltrain.run.scoring.score), beside the user code's failures by kind
SAMPLE_COUNTS = ("failures/outside_policy", "failures/policy")
FLAT_STEPS = 3  # steps in a row without reward variance before the run says nothing is learned
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
        # what a step's reward is the sum of: each weighted function and the overlong penalty
        penalty = ["overlong"] if config.algorithm.overlong == "soft_penalty" else []
        self.components = [*map(reward_name, config.reward.functions), *penalty]
        # a resumed run re-runs the steps after its checkpoint: their old rows go, in every log
        # (a fresh run logs its own step 0, the evaluation before training: an earlier run's goes too)
        truncate_metrics(out_dir / "metrics.jsonl", start_step if start_step else -1)
        self.jsonl = (out_dir / "metrics.jsonl").open("a")
        self.tensorboard = SummaryWriter(
            str(out_dir / "tensorboard"), purge_step=start_step + 1 if start_step else 0
        )
        self.wandb = None
        if config.run.wandb_project:
            import wandb

            self.wandb = wandb.init(
                project=config.run.wandb_project,
                config=config.model_dump(mode="json"),
                dir=str(out_dir),
                resume="allow",
            )
        self.trackio = None
        if config.run.trackio_project:
            os.environ.setdefault("TRACKIO_DIR", str(out_dir / "trackio"))  # (read when trackio is imported)
            import trackio

            trackio.init(project=config.run.trackio_project, config=config.model_dump(mode="json"),
                         resume="allow", auto_log_cpu=False, auto_log_gpu=False)  # fmt: skip
            self.trackio = trackio
        self.flat_steps = 0  # steps in a row in which every group scored the same
        # (a run without tools shows no tool-call rate: an environment's or an agent's may have some)
        self.tools = bool(config.rollout.tools.enabled) or config.episodic
        # a bar on a terminal; in a log file (CI, `ray job submit`) the per-step lines alone
        self.bar = tqdm(total=config.run.steps, initial=start_step, desc="training", unit="step",
                        dynamic_ncols=True, disable=None)  # fmt: skip

    def log(self, step: int, metrics: dict[str, float], advance: bool = True, note: str = "") -> None:
        """One row for ``step``; ``advance=False`` for a row that is not a training step (step 0);
        ``note``: a word the step line ends with (most episodes failed, and why)."""
        self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
        self.jsonl.flush()
        for key, value in metrics.items():
            self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.trackio is not None:
            self.trackio.log(metrics, step=step)
        parts = [f"{name} {fmt.format(metrics[key])}" for name, key, fmt in SUMMARY if key in metrics]
        shown = [
            f"{name} {metrics[f'reward/{name}']:.3f}"
            for name in self.components
            if f"reward/{name}" in metrics
        ]
        if len(self.components) > 1 and shown and parts and parts[0].startswith("reward "):
            parts[0] += f" ({', '.join(shown)})"
        if failed := sum(
            v for k, v in metrics.items() if k.startswith("failures/") and k not in SAMPLE_COUNTS
        ):
            parts.append(f"user-code failures {failed:.0f}")
        if score := held_out_score(metrics):
            shown = f"{metrics[score]:.3f}" if score == "eval/reward" else f"{metrics[score]:.0%}"
            label = {"eval/accuracy": "", "eval/success": "success ", "eval/reward": "reward "}[score]
            tools = f" (tool {metrics['eval/tool_call_rate']:.0%})" if self.tools else ""
            parts.append(f"held-out {label}{shown}{tools}")
        if note:
            parts.append(f"({note})")
        self.bar.write(f"step {step}/{self.total} " + " ".join(parts))
        self._say_if_nothing_is_learned(step, metrics)
        self.bar.update(int(advance))

    def _say_if_nothing_is_learned(self, step: int, metrics: dict[str, float]) -> None:
        """Once ``FLAT_STEPS`` steps in a row had no group whose rewards differ, say so: GRPO's
        advantages are then all zero, and the policy does not move."""
        flat = metrics.get("rollout/zero_variance_groups")
        if flat is None:
            return
        self.flat_steps = self.flat_steps + 1 if flat == 1.0 else 0
        if self.flat_steps == FLAT_STEPS:
            self.bar.write(
                f"rltrain: step {step}: every group of the last {FLAT_STEPS} steps scored the same "
                "(rollout/zero_variance_groups = 1): with no reward variance within a group, every "
                "advantage is 0 and nothing is learned; try a reward with partial credit, a larger "
                "algorithm.group_size, a higher rollout.temperature, or a warm start (sft_warmup.steps)"
            )

    def close(self) -> None:
        """Flush and close every writer (the TensorBoard writer's thread included), then draw
        ``curves.png`` and print the held-out table: nothing writes into the run's folder after
        this."""
        self.bar.close()
        self.jsonl.close()
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.trackio is not None:
            self.trackio.finish()
            self.trackio = None
        plot_curves(self.out_dir / "metrics.jsonl", self.out_dir / "curves.png")
        table = eval_table(read_metrics(self.out_dir / "metrics.jsonl"), self.tools)
        if table:
            print(table, flush=True)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_rollouts(path: Path, scored, dropped: bool = True) -> None:
    """``rollouts/step_<N>.jsonl``: a line per sample of a step's :class:`~rltrain.run.scoring.ScoredGroups`
    with what the policy saw and did: messages (assistant turns as generated, tool calls parsed),
    token ids, the mask (1 = sampled by the policy), log-probs, the policy version of each token,
    rewards per function, finish reason, turns; a sample that failed outside the policy, why
    (``failed``) and whether it was kept out of the loss (``dropped``); a black-box agent's episode
    also its calls and the training sequences it split off. Written atomically."""
    group = len(scored.completions) // max(len(scored.prompts), 1)
    lines = []
    for i, c in enumerate(scored.completions):
        prompt = scored.prompts[i // group]
        question = (prompt.row or {}).get("prompt", "")
        if images := images_of(prompt.token_ids):  # each picture named (size, format, digest)
            question = [*({"type": "image", "image": b} for b in images), {"type": "text", "text": question}]
        messages = c.messages or described([{"role": "user", "content": question},
                                            {"role": "assistant", "content": c.text}])  # fmt: skip
        record = {
            "prompt_index": prompt.index,
            "messages": messages,
            "prompt_ids": c.prompt_ids or prompt.token_ids,
            "completion_ids": c.token_ids,
            "completion_mask": c.tool_mask,
            "completion_logprobs": c.logprobs,
            "completion_versions": c.versions,
            # (None: the function does not apply to this sample)
            "rewards": {
                name: None if scores[i].isnan() else float(scores[i])
                for name, scores in scored.per_function.items()
            },  # fmt: skip
            "reward": float(scored.rewards[i]),
            "finish_reason": c.finish_reason,
            "turns": c.turns,
            "tool_calls": c.tool_calls,
            "errors": c.errors,
        }
        if scored.failed and scored.failed[i] is not None:  # failed outside the policy: why
            record["failed"] = scored.failed[i]
            record["dropped"] = dropped  # kept out of the loss (reward.on_failure=drop), or trained on as 0
        if c.calls:  # a black-box agent's episode: its chat completions, and sequences split off
            record["calls"] = c.calls
            record["earlier_sequences"] = [
                {"prompt_ids": e.prompt_ids, "completion_ids": e.token_ids, "completion_mask": e.tool_mask,
                 "completion_logprobs": e.logprobs, "completion_versions": e.versions}
                for e in c.earlier
            ]  # fmt: skip
        lines.append(json.dumps(record))
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, "".join(line + "\n" for line in lines))


# the task's correctness; an environment's or agent's success; else the run's rewards, weighted
def held_out_score(metrics: dict) -> str | None:
    """The key of a row's held-out score (an environment's runs have success, not accuracy)."""
    return next((key for key, _ in HELD_OUT_SCORES if key in metrics), None)


def eval_table(rows: list[dict], tools: bool = True) -> str:
    """Held-out results at the first and the last evaluation of the run, side by side (``tools``:
    with the tool-call rate)."""
    evals = [r for r in rows if held_out_score(r)]
    if len(evals) < 2:
        return ""
    first, last = evals[0], evals[-1]
    score = held_out_score(first)
    lines = [f"{'held-out (greedy)':<22}{'step ' + str(first['step']):>10}{'step ' + str(last['step']):>10}"]
    score_format = "{:.3f}" if score == "eval/reward" else "{:.1%}"
    rows = [(dict(HELD_OUT_SCORES)[score], score, score_format),
            *[(f"reward {key.removeprefix('eval/reward/')}", key, "{:.3f}") for key in first
              if key.startswith("eval/reward/") and score == "eval/reward"],
            ("tool-call rate", "eval/tool_call_rate", "{:.1%}"), ("turns", "eval/turns", "{:.2f}"),
            ("response length", "eval/response_length", "{:.1f}")]  # fmt: skip
    for name, key, fmt in rows:
        if key == "eval/tool_call_rate" and not tools:
            continue
        if key in first and key in last:
            lines.append(f"{name:<22}{fmt.format(first[key]):>10}{fmt.format(last[key]):>10}")
    return "\n".join(lines)


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep the rows of steps up to ``last_step`` (atomically: a crash leaves the old file or the new)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line)["step"] <= last_step
    ]
    _write_atomically(path, "".join(line + "\n" for line in kept))


def _write_atomically(path: Path, text: str) -> None:
    """A crash leaves the old file or the new one, never half of it."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)
