"""Held-out evaluation: greedy decoding through the generators, scored by the run's own reward
functions (``eval.reward_functions``), tool use.

During training ``run.eval_every`` logs ``eval/*`` at the start, every N steps and at the end. The same
scoring of a saved model:

    python -m rltrain.run.eval --model runs/cpu_demo/final_model --config configs/cpu_demo.yaml
    rltrain eval --model runs/cpu_demo/final_model --config configs/cpu_demo.yaml
"""

from __future__ import annotations

import argparse
import json
import sys

from rltrain.config import Config, ConfigError, load_config
from rltrain.data import Prompt
from rltrain.run.launch import connect_ray, quiet_console
from rltrain.run.preflight import preflight

EVAL_SEED = 7  # greedy decoding does not sample; the seed only fixes request ids
CORRECTNESS = ("math", "exact_match", "reasoning_gym")  # reward functions whose full credit is a right answer


def evaluate(
    generators,
    prompts: list[Prompt],
    scorer,
    own: str | None = None,
    functions: dict[str, float] | None = None,
    model_scorers: dict | None = None,
) -> dict[str, float]:
    """Greedy completions of ``prompts`` scored by ``functions`` (the run's reward functions, as
    :attr:`Config.eval_functions` picks them; when not given, `math`, or an episode's own reward): ``eval/reward/<name>``
    per function, ``eval/reward`` weighted, ``eval/accuracy`` where a correctness function (math,
    exact match, reasoning_gym) is among them: the share it gives full credit (a scorer's partial
    credit counts in ``eval/reward/<name>`` alone); ``eval/tool_call_rate`` (completions that called a tool),
    ``eval/tool_errors``, ``eval/response_length``. With an environment or an agent (``own``: the
    reward an episode gives itself, `env` or `agent`; the prompts are its rows) also
    ``eval/success`` (episodes whose reward is positive), ``eval/env_reward`` (an agent's:
    ``eval/agent_reward``), ``eval/turns``, ``eval/failed`` (episodes that failed outside the
    policy), and a verifiers environment's scores by name (``eval/env/<name>``). ``model_scorers``:
    a reward model's and a judge's, where they are among ``functions``."""
    from rltrain.rewards.functions import AGENT, ENV, GIVEN, reward_name
    from rltrain.run.scoring import batch_columns, mean_metrics

    requests = [p.row if own else p.token_ids for p in prompts]
    completions = generators.collect(generators.submit(requests, [EVAL_SEED] * len(prompts), greedy=True))
    n = len(completions)
    functions = functions or {own or "math": 1.0}
    given = {ENV: [c.env_reward for c in completions], AGENT: [c.agent_reward for c in completions]}
    for name, model_scorer in (model_scorers or {}).items():
        if name in functions:
            given[name] = model_scorer(prompts, completions)[0]
    texts, answers = [c.text for c in completions], [p.answer for p in prompts]
    columns = batch_columns(prompts) if prompts and prompts[0].row else None
    scores, right, total = {}, {}, [0.0] * n
    for spec, weight in functions.items():
        if spec in GIVEN:
            values = given.get(spec, [None] * n)
        else:
            values = scorer.one(spec, texts, answers, columns)
        values = [v or 0.0 for v in values]
        scores[reward_name(spec)] = sum(values) / n
        right[spec] = sum(v >= 1.0 for v in values) / n
        total = [t + weight * v for t, v in zip(total, values)]
    quality = {"eval/reward": sum(total) / n, **{f"eval/reward/{name}": v for name, v in scores.items()}}
    if own:
        rewards = [v or 0.0 for v in given[own]]
        quality |= {
            "eval/success": sum(r > 0 for r in rewards) / n,
            f"eval/{own}_reward": sum(rewards) / n,
            "eval/turns": sum(c.turns for c in completions) / n,
            "eval/failed": sum(c.finish_reason == "error" for c in completions) / n,
            **{f"eval/env/{k}": v for k, v in mean_metrics(completions).items()},
        }
    elif correctness := next((s for s in CORRECTNESS if s in functions), None):
        quality["eval/accuracy"] = right[correctness]
    return {
        **quality,
        "eval/tool_call_rate": sum(c.tool_calls > 0 for c in completions) / n,
        "eval/tool_errors": sum(c.tool_errors for c in completions) / n,
        "eval/response_length": sum(len(c.token_ids) for c in completions) / n,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rltrain eval", description="Score a saved model on held-out prompts."
    )
    parser.add_argument(
        "--model", required=True, help="a saved model folder (final_model/, checkpoints/step_N/hf)"
    )
    parser.add_argument("--config", help="the run's config (its data, eval, rollout and tools sections)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.num_prompts=200")
    args = parser.parse_args(argv)
    quiet_console()
    import tempfile

    scratch = tempfile.mkdtemp(prefix="rltrain-eval-")  # preflight's output folder: nothing is kept there
    try:
        overrides = [*args.overrides, f"model.name_or_path={args.model}", f"run.output_dir={scratch}"]
        config = load_config(args.config, overrides)
        config = config.model_copy(update={"run": config.run.model_copy(update={"eval_every": 1})})
        inputs = preflight(config)
        connect_ray(_one_engine(config), inputs.model_path)
    except ConfigError as e:
        print(f"rltrain: config error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"model": args.model, **score_model(config, inputs)}))
    return 0


def _one_engine(config: Config) -> Config:
    """Evaluation needs the generators only."""
    return config.model_copy(
        update={"learner": config.learner.model_copy(update={"num_learners": 0}), "critic": None}
    )


def score_model(config: Config, inputs) -> dict[str, float]:
    from rltrain.rewards.functions import RewardScorer
    from rltrain.rollout import GeneratorPool

    generators = GeneratorPool(config, inputs.model_path)
    try:
        functions = config.eval_functions
        if config.eval.reward_functions is None:  # (no reward model or judge actors here)
            functions = {k: v for k, v in functions.items() if k not in ("model", "judge")} or {"math": 1.0}
        with RewardScorer(functions, config.reward.timeout_s, config.reward.workers) as scorer:
            return evaluate(generators, inputs.eval_prompts, scorer, config.episode_reward, functions)
    finally:
        generators.shutdown()


if __name__ == "__main__":
    sys.exit(main())
