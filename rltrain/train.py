"""The command line: train, or score a saved model.

    python -m rltrain.train --config configs/cpu_demo.yaml [section.key=value ...]
    rltrain eval --model FOLDER --config FILE     (held-out scoring, see rltrain.run.eval)
    rltrain serve --config configs/cpu_tinker.yaml  (the Tinker API, see rltrain.serve)

With ``RAY_ADDRESS`` set (as under ``ray job submit``) it joins that cluster; otherwise it starts a
local Ray instance. Problems with the inputs (config, data, model, output folder, lengths, reward
and tool specs) exit with code 2 and one line before any actor starts. An actor that dies or stops
answering restarts every actor from the newest checkpoint, up to ``run.max_restarts`` times; past
that the run exits with code 1 and one line saying how to resume.

The loop itself is :mod:`rltrain.run.loop`.
"""

from __future__ import annotations

import argparse
import sys

from rltrain.config import BUILTIN_MODELS, ConfigError, describe, describe_respelled, load_config

# The trainer's modules (torch, transformers, Ray) are imported where a run starts, not at this
# module's top: the reward workers are spawned, and a spawned process imports its parent's main
# module, this one under `python -m rltrain.train` (light, a worker starts in 0.6 s rather than 4).


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rltrain", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config file (configs/*.yaml)")
    parser.add_argument("--help-config", nargs="?", const="", metavar="SECTION",
                        help="list every config key (or those of SECTION, e.g. rollout or rollout.tools) with the "
                        "values this run would use (--config and overrides applied), and exit")  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. run.steps=5 loss.kl_beta=0.01")
    argv = sys.argv[1:] if argv is None else argv
    from rltrain.run.launch import quiet_console

    quiet_console()
    if argv[:1] == ["eval"]:  # `rltrain eval ...`: score a saved model on the held-out prompts
        from rltrain.run.eval import main as eval_main

        return eval_main(argv[1:])
    if argv[:1] == ["serve"]:  # `rltrain serve ...`: the Tinker API on the learners
        from rltrain.serve.setup import main as serve_main

        return serve_main(argv[1:])
    args = parser.parse_args(argv)
    if args.help_config is not None:
        return help_config(args)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Train with ``--config`` and the overrides; the exit code."""
    from rltrain.run import checkpoint
    from rltrain.run.launch import connect_ray
    from rltrain.run.loop import Interrupted, RunFailed, train
    from rltrain.run.preflight import preflight
    from rltrain.run.user_code import UserCodeFailed

    try:
        config = load_config(args.config, args.overrides)
        inputs = preflight(config)
        connect_ray(config, inputs.model_path)
    except ConfigError as e:
        print(f"rltrain: config error: {e}", file=sys.stderr)
        return 2
    try:
        out = train(config, inputs)
    except ConfigError as e:  # at start-up: what a fresh start would meet again
        print(f"rltrain: {e}", file=sys.stderr)
        return 2
    except (RunFailed, UserCodeFailed, checkpoint.SaveFailed) as e:  # SaveFailed: the warm start's model
        print(f"rltrain: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # (the run saved what it trained)
        stopped = e if isinstance(e, Interrupted) else e.__context__  # a third Ctrl-C while it wound down
        print(
            f"rltrain: {stopped}" if isinstance(stopped, Interrupted) else "rltrain: interrupted",
            file=sys.stderr,
        )
        return 130
    print(outputs_line(out), flush=True)
    return 0


OUTPUTS = {  # what a run folder may hold, in the order a reader wants it
    "final_model": "final_model/ (loads with from_pretrained)",
    "final_adapter": "final_adapter/ (the LoRA adapter; loads onto the base model with peft)",
    "final_critic": "final_critic/",
    "checkpoints": "checkpoints/ (resume with run.resume=true)",
    "metrics.jsonl": "metrics.jsonl",
    "tensorboard": "tensorboard/",
    "curves.png": "curves.png",
    "rollouts": "rollouts/",
    "errors": "errors/ (tracebacks of your code)",
    "config.yaml": "config.yaml",
}


def outputs_line(out) -> str:
    """The run's last line: where its outputs are and what is there."""
    present = [text for name, text in OUTPUTS.items() if (out / name).exists()]
    return f"rltrain: done; outputs in {out}/: {', '.join(present)}"


def help_config(args: argparse.Namespace) -> int:
    """``--help-config [SECTION]``: the keys with the values of ``--config`` and the overrides."""
    from rltrain.data import BUILTIN_SOURCES
    from rltrain.episodes.environments import BUILTIN as ENVIRONMENTS
    from rltrain.rewards.functions import BUILTIN as REWARDS
    from rltrain.rewards.functions import GIVEN

    section, overrides = args.help_config, list(args.overrides)
    if "=" in section:  # `--help-config key=value`: an override, not a section
        section, overrides = "", [section, *overrides]
    builtins = {
        "env.name": [f"builtin:{name}" for name in ENVIRONMENTS],
        "data.source": list(BUILTIN_SOURCES),
        "eval.source": list(BUILTIN_SOURCES),
        "reward.functions": [*REWARDS, *GIVEN],
        "model.name_or_path": list(BUILTIN_MODELS),
    }
    try:
        print(describe(load_config(args.config, overrides), section or None, builtins))
        older = describe_respelled(section or None)
        if older:
            print(f"\n{older}")
    except ConfigError as e:
        print(f"rltrain: config error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
