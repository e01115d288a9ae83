"""What a critic can learn from a PPO run's own rollouts: fresh critics of different settings replay them.

    python benchmarks/critic_replay.py RUN_FOLDER [--variants shipped lr=3e-4 ...]

RUN_FOLDER is a PPO run saved with ``run.save_rollouts_every=1`` and ``gamma = lam = 1`` (every
loss token's return is its completion's reward): ``rollouts/step_<N>.jsonl`` and ``sft_model/``
(the warm start the run's critic started from). Each variant starts a critic from the warm start
with a zero value head and goes through the steps in order, as the run's critic learner does:
the values of step N's samples are scored before the critic trains on them, then it takes its
optimizer steps on them. Two scores a step: the explained variance ``1 - Var(R - V) / Var(R)`` over
the loss tokens (``critic/explained_variance``), and over the samples at their question, the value
of the state before the first sampled token (``critic/question_explained_variance``: what the critic
thinks the question is worth, comparable with the prompt oracle). ``shipped before`` (AdamW, lr
3e-3, one optimizer step a step, gradient norm clipped at 1) reproduces a run of that setting's own
``critic/explained_variance`` step for step, so the variants differ from the run in their setting
alone, on the same samples.

``pooled`` is an upper bound of another kind: a critic trained 4 epochs on every sample of the
first three quarters of the steps at once, scored on the last quarter.
Beside them, the run's prompt oracle (``critic_variance.py``): what knowing each question's
success rate exactly would explain.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from common import mean_of, rollout_paths, table
from critic_variance import run_figures
from transformers import AutoConfig, AutoModelForTokenClassification


@dataclass(frozen=True)
class Variant:
    lr: float = 3e-3
    epochs: int = 1
    minibatches: int = 1  # optimizer steps per epoch
    head_only: bool = False  # the warm start's trunk frozen: a value head on the policy's features
    random_init: bool = False  # the same architecture, fresh weights
    normalize: bool = False  # targets scaled by the running mean and std of the returns seen
    lam: float = 1.0  # GAE's lambda (gamma 1): bootstrapped targets from the rollout-time values


VARIANTS = {
    "shipped before (lr 3e-3, 1 step)": Variant(),
    "cpu_ppo.yaml (lr 3e-4, 4 epochs x 4)": Variant(lr=3e-4, epochs=4, minibatches=4),
    "lr 1e-3": Variant(lr=1e-3),
    "lr 3e-4": Variant(lr=3e-4),
    "lr 3e-4, 4 epochs": Variant(lr=3e-4, epochs=4),
    "lr 3e-4, 4 mini-batches": Variant(lr=3e-4, minibatches=4),
    "head only (trunk frozen), lr 1e-3": Variant(lr=1e-3, head_only=True),
    "random init": Variant(random_init=True),
    "random init, 4 epochs x 4": Variant(random_init=True, lr=3e-4, epochs=4, minibatches=4),
    "return normalization": Variant(normalize=True),
    "return normalization, 4 epochs x 4": Variant(normalize=True, lr=3e-4, epochs=4, minibatches=4),
    "lam 0.95": Variant(lam=0.95),
}
PLOTTED = ["shipped before (lr 3e-3, 1 step)", "cpu_ppo.yaml (lr 3e-4, 4 epochs x 4)", "return normalization"]
MICRO = 16


@dataclass
class Sample:
    ids: list[int]
    keep: list[int]  # the loss tokens: sampled by the policy (not prompt, not tool output)
    reward: float


def variant(name: str) -> Variant:
    """A named variant, or fields spelled out: ``lr=1e-3,epochs=4,minibatches=4,normalize=1``."""
    if name in VARIANTS:
        return VARIANTS[name]
    fields = {k: v for k, v in (part.split("=") for part in name.split(","))}
    types = {k: type(getattr(Variant(), k)) for k in fields}
    return replace(
        Variant(), **{k: types[k](float(v)) if types[k] is not bool else v == "1" for k, v in fields.items()}
    )


def load_step(run: Path, step: int) -> list[Sample]:
    rows = [json.loads(line) for line in (run / f"rollouts/step_{step}.jsonl").read_text().splitlines()]
    return [Sample(r["prompt_ids"] + r["completion_ids"], [0] * len(r["prompt_ids"]) + r["completion_mask"],
                   float(r["reward"])) for r in rows]  # fmt: skip


def tensors(samples: list[Sample]) -> tuple[torch.Tensor, ...]:
    width = max(len(s.ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    attention, keep = torch.zeros_like(ids), torch.zeros(len(samples), width)
    for row, s in enumerate(samples):
        ids[row, : len(s.ids)] = torch.tensor(s.ids)
        attention[row, : len(s.ids)] = 1
        keep[row, : len(s.keep)] = torch.tensor(s.keep, dtype=torch.float)
    rewards = torch.tensor([s.reward for s in samples])[:, None].expand_as(keep)
    return ids, attention, keep, rewards


def explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    if returns.var() <= 1e-12:
        return float("nan")
    return float(1 - (returns - values).var() / returns.var())


class Replay:
    def __init__(self, run: Path, v: Variant, seed: int = 0):
        torch.manual_seed(seed)
        self.v = v
        if v.random_init:
            config = AutoConfig.from_pretrained(run / "sft_model", num_labels=1)
            self.model = AutoModelForTokenClassification.from_config(config)
        else:
            self.model = AutoModelForTokenClassification.from_pretrained(run / "sft_model", num_labels=1)
        head = [p for n, p in self.model.named_parameters() if n.startswith("score")]
        for p in head:
            torch.nn.init.zeros_(p)
        params = head if v.head_only else list(self.model.parameters())
        for p in self.model.parameters():
            p.requires_grad_(not v.head_only or any(p is h for h in head))
        self.opt = torch.optim.AdamW(params, lr=v.lr, weight_decay=0.0)
        self.count, self.mean, self.m2 = 0, 0.0, 0.0  # running return statistics (Welford)

    def scale(self) -> tuple[float, float]:
        if not self.v.normalize or self.count < 2:
            return 0.0, 1.0
        return self.mean, max((self.m2 / (self.count - 1)) ** 0.5, 1e-3)

    def outputs(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """``[B, T]``: the head's output for the state before each token (normalized units)."""
        return F.pad(self.model(input_ids=ids, attention_mask=attention).logits[..., 0][:, :-1], (1, 0))

    def values(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """``[B, T]``: the value of the state before each token, in return units."""
        shift, spread = self.scale()
        return self.outputs(ids, attention) * spread + shift

    def targets(self, values: torch.Tensor, keep: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
        """gamma 1: lam 1 gives the reward at every loss token; lam < 1 bootstraps from the next loss
        token's rollout-time value (the recursion carries over the positions that are not steps)."""
        if self.v.lam == 1.0:
            return rewards
        out = torch.zeros_like(values)
        for row in range(values.shape[0]):
            positions = keep[row].nonzero()[:, 0].tolist()
            advantage, next_value = 0.0, None
            for t in reversed(positions):
                delta = (rewards[row, t] if next_value is None else next_value) - values[row, t]
                advantage = delta + (self.v.lam * advantage if next_value is not None else 0.0)
                out[row, t] = advantage + values[row, t]
                next_value = values[row, t]
        return out

    def step(self, samples: list[Sample]) -> tuple[float, float]:
        """Score the values of the samples, then train on them; returns the explained variance over
        the loss tokens and over the samples at their question (the value before the first token)."""
        batches = [tensors(samples[i : i + MICRO]) for i in range(0, len(samples), MICRO)]
        with torch.no_grad():
            old = [self.values(ids, attention) for ids, attention, _, _ in batches]
        keep = torch.cat([b[2].flatten() for b in batches]).bool()
        returns = torch.cat([b[3].flatten() for b in batches])[keep]
        explained = explained_variance(returns, torch.cat([v.flatten() for v in old])[keep])
        # the question's worth: the value of the state before the first sampled token, per sample
        first = [(b[2].cumsum(1) == 1) & b[2].bool() for b in batches]
        question = explained_variance(
            torch.cat([b[3][f] for b, f in zip(batches, first)]),
            torch.cat([v[f] for v, f in zip(old, first)]),
        )
        targets = [self.targets(v, b[2], b[3]) for v, b in zip(old, batches)]
        for r in (s.reward for s in samples):  # the statistics of every sample's return
            self.count += 1
            delta = r - self.mean
            self.mean += delta / self.count
            self.m2 += delta * (r - self.mean)
        self.train([(b[0], b[1], b[2], t) for b, t in zip(batches, targets)])
        return explained, question

    def train(self, batches: list[tuple[torch.Tensor, ...]]) -> None:
        rng = random.Random(0)
        shift, spread = self.scale()
        for epoch in range(self.v.epochs):
            order = list(range(len(batches)))
            if epoch:
                rng.shuffle(order)
            per = max(1, len(order) // self.v.minibatches)
            for start in range(0, len(order), per):
                chosen = [batches[i] for i in order[start : start + per]]
                tokens = sum(float(b[2].sum()) for b in chosen)
                self.opt.zero_grad()
                for ids, attention, keep, target in chosen:
                    out = self.outputs(ids, attention)
                    loss = (0.5 * (out - (target - shift) / spread) ** 2 * keep).sum() / tokens
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.opt.step()


def pooled(run: Path, steps: list[int]) -> tuple[float, float]:
    """A critic trained on every sample of the first three quarters at once (4 epochs of mini-batches
    of 64, lr 3e-4), scored on the last quarter: the explained variance of what it never saw."""
    cut = steps[(3 * len(steps)) // 4]
    train = [s for step in steps if step < cut for s in load_step(run, step)]
    replay = Replay(run, Variant(lr=3e-4, epochs=1))
    rng = random.Random(0)
    for _ in range(4):
        rng.shuffle(train)
        for i in range(0, len(train), 64):
            chunk = train[i : i + 64]
            replay.train([tensors(chunk[j : j + MICRO]) for j in range(0, len(chunk), MICRO)])
    scores = [replay.step(load_step(run, step)) for step in steps if step >= cut]
    return mean_of([t for t, _ in scores]), mean_of([q for _, q in scores])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--variants", nargs="*", default=[*VARIANTS, "pooled"],
                        help=f"of: {', '.join(VARIANTS)}, pooled")  # fmt: skip
    parser.add_argument("--last", type=int, default=10)
    parser.add_argument("--plot", type=Path, help="a PNG of the per-step explained variances")
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()  # each fresh critic's load report: the new head
    steps = [int(p.stem.split("_")[1]) for p in rollout_paths(args.run)]
    rows, curves = [], {}
    for name in args.variants:
        if name == "pooled":
            tokens, question = pooled(args.run, steps)
            rows.append([name, "-", f"{tokens:.3f}", "-", f"{question:.3f}"])
            continue
        replay = Replay(args.run, variant(name))
        curves[name] = [replay.step(load_step(args.run, step)) for step in steps]
        head, tail = curves[name][: args.last], curves[name][-args.last :]
        rows.append(
            [name] + [f"{mean_of([s[i] for s in part]):.3f}" for i in (0, 1) for part in (head, tail)]
        )
        print(" | ".join(rows[-1]), flush=True)
    figures = run_figures(args.run, args.last)
    print(f"{args.run}, last {args.last} steps: prompt oracle {figures['prompt oracle EV']:.2f} pooled, "
          f"{figures['prompt oracle EV, mean of steps']:.2f} mean of steps")  # fmt: skip
    print(table(["critic", f"EV over tokens, first {args.last} steps", f"last {args.last}",
                 f"EV at the question, first {args.last} steps", f"last {args.last}"], rows))  # fmt: skip
    if args.plot:
        plot(args.run, steps, curves, args.plot)


def plot(run: Path, steps: list[int], curves: dict[str, list[tuple[float, float]]], path: Path) -> None:
    """Two panels: the explained variance over the loss tokens, and at the question beside the prompt
    oracle of each step (``critic_variance.py``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    oracle = [run_figures(run, 1, first=True, only=step)["prompt oracle EV"] for step in steps]
    axes[1].plot(steps, oracle, color="gray", linestyle="--", label="prompt oracle")
    for name in [n for n in PLOTTED if n in curves] or list(curves):
        for i, ax in enumerate(axes):
            ax.plot(steps, [s[i] for s in curves[name]], label=name)
    for ax, title in zip(axes, ["over the loss tokens (critic/explained_variance)",
                                "at the question, per sample (critic/question_explained_variance)"]):  # fmt: skip
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylim(-0.5, 1.0)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{run.name}: a fresh critic replaying the run's rollouts", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
