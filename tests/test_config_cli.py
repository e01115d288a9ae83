"""Bad config fails before anything starts: exit code 2, one line naming key, value and what is allowed."""

import subprocess
import sys
from pathlib import Path

import pytest

from rltrain.config import ConfigError, load_config
from rltrain.train import main

CASES = {
    "unknown key": (["loss.masked_mean_denominater=token"], "loss.masked_mean_denominater: unknown key"),
    "min_p of 1": (["rollout.min_p=1"], "rollout.min_p: got 1"),
    "wrong type": (["learner.micro_batch_size=four"], "learner.micro_batch_size: got 'four'"),
    "bad denominator": (
        ["loss.masked_mean_denominator=tokens"],
        "loss.masked_mean_denominator: got 'tokens'; expected null (per-micro-batch mean), "
        'a positive number, or "token"',
    ),
    "zero denominator": (["loss.masked_mean_denominator=0"], "loss.masked_mean_denominator: got 0;"),
    "older spelling, a value it cannot take": (
        ["loss.masked_mean_axis=0"],
        "loss.masked_mean_axis: only 1 is accepted, got 0 (the older spelling of loss.aggregation: "
        "1: seq-mean-token-mean; null: unset)",
    ),
    "unknown aggregation": (
        ["loss.aggregation=seq-mean"],
        "loss.aggregation: got 'seq-mean'; Input should be",
    ),
    "zero aggregation norm": (["loss.aggregation_norm=0"], "loss.aggregation_norm: got 0;"),
    "load-balancing loss on a dense model": (
        ["loss.moe_aux_coef=0.01"],
        "loss.moe_aux_coef=0.01: builtin:tiny is not a mixture of experts",
    ),
    "routing replay on a dense model": (
        ["rollout.routing_replay=true"],
        "rollout.routing_replay: builtin:tiny is not a mixture of experts (no routes to replay)",
    ),
    "routing replay of an environment's episodes": (
        [
            "model.name_or_path=builtin:tiny-moe",
            "rollout.routing_replay=true",
            "env.name=builtin:guess",
            "data.source=builtin:guess",
            "reward.functions={env: 1.0}",
        ],
        "rollout.routing_replay with env.name: the routes of an episode's turns are not recorded yet",
    ),
    "unknown load-balancing scope": (["loss.moe_aux_scope=forward"], "loss.moe_aux_scope: got 'forward';"),
    "LoRA on a mixture of experts in vLLM on CPU": (
        ["model.name_or_path=builtin:tiny-moe", "model.lora.rank=8"],
        "model.lora.rank with a mixture of experts: vLLM's CPU engine cannot serve LoRA adapters",
    ),
    "too many learners": (
        ["learner.num_learners=8", "learner.cpus_per_learner=1", "run.ray_num_cpus=2"],
        "learner.num_learners: 8 learners x 1.0 CPU + 1 engines x 0.5 CPU need 8.5 CPUs, the cluster has 2",
    ),
    "missing model": (["model.name_or_path=./no/such/model"], "model.name_or_path: got './no/such/model'"),
    "out of range": (
        ["algorithm.group_size=1"],
        "algorithm.group_size: got 1; Input should be greater than or equal to 2",
    ),
    "bad reward": (["reward.functions={nosuch: 1.0}"], "reward.functions: 'nosuch' is neither a built-in"),
    "missing data": (["data.source=./no/data.jsonl"], "data.source: './no/data.jsonl' does not exist"),
    "gae without a critic": (["algorithm.advantage=gae"], "algorithm.advantage=gae needs a critic section"),
    "critic with a group estimator": (
        ["critic.warmup_steps=2"],
        "critic: set, but algorithm.advantage=grpo ignores it",
    ),
    "critic does not fit": (
        ["algorithm.advantage=gae", "critic.learners.num_learners=3", "run.ray_num_cpus=2"],
        "2 learners x 0.5 CPU + 1 engines x 0.5 CPU + 3 critic learners x 0.5 CPU need 3 CPUs, the cluster has 2",
    ),
    "sequence parallel size": (
        ["learner.sequence_parallel_size=3"],
        "learner.sequence_parallel_size=3 does not divide learner.num_learners=2",
    ),
    "sequence parallel heads": (
        ["learner.num_learners=4", "learner.sequence_parallel_size=4", "run.ray_num_cpus=4"],
        "learner.sequence_parallel_size=4 does not divide the model's 2 attention heads",
    ),
    "override that is not YAML": (["run.steps=[1,"], "override 'run.steps=[1,': the value is not valid YAML"),
    "infinite learning rate": (["learner.lr=.inf"], "learner.lr: got inf; Input should be a finite number"),
    "NaN reward weight": (
        ["reward.functions={math: .nan}"],
        "reward.functions.math: got nan; Input should be a finite",
    ),
    "empty reward set": (
        ["reward.functions={}"],
        "reward.functions: got {}; Dictionary should have at least 1 item",
    ),
    "negative eval interval": (["run.eval_every=-1"], "run.eval_every: got -1; Input should be greater than"),
    "distillation without a teacher": (
        ["algorithm.advantage=distill"],
        "algorithm.advantage=distill needs algorithm.teacher",
    ),
    "a reward model without its weight": (
        ["reward.model=some/rm"],
        "reward.model: set, but reward.functions (math) has no `model` weight",
    ),
    "the model's weight without a reward model": (
        ["reward.functions={model: 1.0}"],
        "reward.functions: `model` is reward.model's score; set both or neither",
    ),
    "token budget": (
        ["learner.max_tokens_per_micro_batch=64"],
        "learner.max_tokens_per_micro_batch=64 cannot hold one sequence of up to 208 tokens",  # 128 + 80
    ),
}


def fails_with_one_line(argv: list[str], expected: str | tuple[str, ...], capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("rltrain: config error: ")
    for part in (expected,) if isinstance(expected, str) else expected:
        assert part in err, err


@pytest.mark.parametrize("case", CASES)
def test_bad_config_gives_one_line_and_exit_code_2(case, capsys, tmp_path):
    overrides, expected = CASES[case]
    fails_with_one_line(
        ["--config", "configs/cpu_demo.yaml", f"run.output_dir={tmp_path}", *overrides], expected, capsys
    )


def jsonl(tmp_path, *lines: str, key: str = "data.source") -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return f"{key}={path}"


# input problem -> (overrides built in tmp_path, what the one line must say)
INPUTS = {
    "unreadable row": (
        lambda t: [jsonl(t, '{"prompt": "1+1?", "answer": "2"}', '{"prompt": "2+2?", "answer": ')],
        "data.source: data.jsonl line 2 is not valid JSON",
    ),
    "missing column": (
        lambda t: [jsonl(t, '{"prompt": "1+1?", "solution": "2"}')],
        "data.jsonl line 1 has no column 'answer' (data.answer_key); it has ['prompt', 'solution']",
    ),
    "bad value": (
        lambda t: [jsonl(t, '{"prompt": "1+1?", "answer": "2"}', '{"prompt": null, "answer": "4"}')],
        "data.jsonl line 2, column 'prompt': expected a non-empty string, got None",
    ),
    "unknown built-in data": (lambda t: ["data.source=builtin:chess"], "unknown built-in 'builtin:chess'"),
    "unknown reasoning-gym task": (
        lambda t: ["data.source=reasoning_gym:chain_summ", "sft_warmup.steps=0"],
        "data.source: reasoning-gym has no dataset 'chain_summ'; did you mean chain_sum",
    ),
    "a reasoning-gym setting its task does not take": (
        lambda t: [
            "data.source=reasoning_gym:chain_sum",
            "sft_warmup.steps=0",
            "data.task_config={bogus: 3}",
        ],
        "data.source: reasoning-gym's 'chain_sum' does not take data.task_config {'bogus': 3}",
    ),
    "an unknown verifiers taskset": (
        lambda t: ["env.name=verifiers:vf_sumz", "sft_warmup.steps=0", "eval.num_prompts=4"],
        "env.name=verifiers:vf_sumz (env.kwargs {}) does not load: ModuleNotFoundError: taskset 'vf_sumz' not found",
    ),
    "a verifiers setting its taskset does not take": (
        lambda t: ["env.name=verifiers:vf_sums", "env.kwargs={num_taskz: 3}", "sft_warmup.steps=0"],
        (
            "env.name=verifiers:vf_sums (env.kwargs {'num_taskz': 3}) does not load: ValidationError",
            "taskset.num_taskz Extra inputs are not permitted",
        ),
    ),
    "a built-in arithmetic setting it does not take": (
        lambda t: ["data.task_config={digits: [1, 7]}"],
        "data.task_config: builtin:arithmetic takes one setting, digits (a list of operand lengths, 1-6), "
        "got {'digits': [1, 7]}",
    ),
    "output folder is a file": (
        lambda t: [f"run.output_dir={(t / 'taken').write_text('') or t / 'taken'}"],
        "taken' is a file, expected a folder",
    ),
    "model folder without config.json": (
        lambda t: [f"model.name_or_path={(t / 'empty').mkdir() or t / 'empty'}"],
        "has no config.json (not a transformers model folder)",
    ),
    "missing .gguf file": (
        lambda t: [f"model.name_or_path={t / 'model.gguf'}"],
        "model.gguf' is not a file (a .gguf checkpoint must be a local file)",
    ),
    ".gguf file that is not one": (
        lambda t: [f"model.name_or_path={(t / 'm.gguf').write_text('not gguf') and t / 'm.gguf'}"],
        "m.gguf' does not load:",
    ),
    "lengths over max_model_len": (
        lambda t: ["data.max_prompt_tokens=500"],
        "data.max_prompt_tokens + rollout.max_new_tokens = 500 + 80 = 580 exceeds rollout.max_model_len=512",
    ),
    "lengths over the model's context": (
        lambda t: ["data.max_prompt_tokens=1100", "rollout.max_model_len=2048"],
        "= 1180 exceeds the context of 1024 tokens of model.name_or_path",
    ),
    "prompt over its limit": (
        lambda t: ["data.max_prompt_tokens=5"],
        "data: prompt 0 has",
    ),
    "unknown tool": (lambda t: ["rollout.tools.enabled=[shell]"], "rollout.tools.enabled.0: got 'shell'"),
    "missing warm-up file": (
        lambda t: [f"sft_warmup.source={t / 'nope.jsonl'}"],
        "nope.jsonl' does not exist",
    ),
    "warm-up row without a completion": (
        lambda t: [
            jsonl(t, '{"prompt": "1+1?", "completion": "2"}', '{"prompt": "2+2?"}', key="sft_warmup.source")
        ],
        (
            "config error: sft_warmup.source '",
            "data.jsonl line 2 has no column 'completion'; it has ['prompt']",
        ),
    ),
    "warm-up conversation without an assistant turn": (  # OpenAI's fine-tuning format: `messages`
        lambda t: [
            jsonl(
                t,
                '{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}',
                '{"messages": [{"role": "user", "content": "2+3?"}]}',
                key="sft_warmup.source",
            )
        ],  # fmt: skip
        "sft_warmup.source: data.jsonl line 2: no assistant message",
    ),
    "missing held-out file": (
        lambda t: ["run.eval_every=5", f"eval.source={t / 'held.jsonl'}"],
        "eval.source: '",
    ),
}


def _checkpoint(
    t, tag: str, hf_config: dict | None = None, pointer: str | None = None, layout: dict | None = None
) -> list[str]:
    """A run folder whose ``checkpoints/latest`` names ``pointer`` (default ``tag``); ``tag`` holds a
    trainer state and, when given, an ``hf/config.json`` and the learner layout that wrote it."""
    import json

    root = t / "run" / "checkpoints"
    (root / tag / "hf").mkdir(parents=True)
    (root / tag / "trainer_state.json").write_text('{"step": 2}')
    if hf_config is not None:
        (root / tag / "hf" / "config.json").write_text(json.dumps(hf_config))
    if layout is not None:
        (root / tag / "layout.json").write_text(json.dumps(layout))
    (root / "latest").write_text(pointer or tag)
    return ["run.resume=true"]


RESUMES = {
    "pointer to a missing checkpoint": (
        lambda t: _checkpoint(t, "step_2", {}, pointer="step_9"),
        ("run.resume: ", "latest names 'step_9', which is not in"),
    ),
    "checkpoint without its model": (
        lambda t: _checkpoint(t, "step_2"),
        "step_2 is incomplete or damaged (hf/config.json: FileNotFoundError)",
    ),
    "checkpoint of another model": (
        lambda t: _checkpoint(t, "step_2", {"model_type": "qwen2", "hidden_size": 999}),
        "holds another model (hidden_size 999; the run's model has 64)",
    ),
    "checkpoint of another layout without its layout-free state": (
        lambda t: _checkpoint(t, "step_2", {}, layout={"num_learners": 4, "zero_stage": 3}),
        (
            "was written by 4 policy learner(s) with ZeRO-3 and holds no layout_free.pt",
            "resume with learner.num_learners=4 and learner.zero_stage=3",
        ),
    ),
}
INPUTS.update(RESUMES)

GUESS = ["env.name=builtin:guess", "data.source=builtin:guess", "reward.functions={env: 1.0}"]
ENV_FIT = ["sft_warmup.steps=0"]  # (the demo warms up on tag-format examples of its own task)


def _rewriting_model(t) -> list[str]:
    """The tiny model with a Qwen3-like template (earlier assistant turns lose their text)."""
    from transformers import AutoTokenizer

    from rltrain.models.tiny import build_tiny_model

    folder = build_tiny_model(t / "model")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{{ message.content or '' }}",
        "{{ '' if messages[loop.index0 + 1:] | selectattr('role', 'equalto', 'user') | list else message.content }}",
    )
    tokenizer.save_pretrained(folder)
    return [*GUESS, f"model.name_or_path={folder}"]


ENVIRONMENTS = {
    "env reward without an environment": (
        lambda t: ["reward.functions={env: 1.0}"],
        "reward.functions: `env` is the environment's reward; it needs env.name",
    ),
    "unknown built-in environment": (
        lambda t: [*GUESS, "env.name=builtin:chess"],
        "env.name: unknown built-in 'builtin:chess' (built-ins: builtin:calculator, builtin:guess, builtin:chain, builtin:shapes)",
    ),
    "environment arguments it does not take": (
        lambda t: [*GUESS, "env.kwargs={top: 9}"],
        "env.kwargs: builtin:guess does not take {'top': 9}",
    ),
    "environment module that is not there": (
        lambda t: [*GUESS, "env.name=no_such_module:Env"],
        "env.name: cannot load 'no_such_module:Env': No module named 'no_such_module'",
    ),
    "an opening prompt longer than data.max_prompt_tokens": (
        lambda t: [*GUESS, "data.max_prompt_tokens=8"],
        "data.max_prompt_tokens=8 is shorter than builtin:guess's opening prompt for the first row (",
    ),
    "native calls without an environment": (
        lambda t: ["rollout.tool_parser=hermes"],
        "rollout.tool_parser=hermes needs an environment",
    ),
    "a tool parser of vLLM's, misspelled": (
        lambda t: [*GUESS, "rollout.tool_parser=lama3_json"],
        "rollout.tool_parser: unknown parser 'lama3_json' (did you mean 'llama3_json'? built in: hermes, tag; vLLM's: ",
    ),
    "a tool parser whose format's tokens the tokenizer lacks": (
        lambda t: [*GUESS, "rollout.tool_parser=llama3_json"],
        "rollout.tool_parser=llama3_json: RuntimeError: Llama3JsonToolParser could not locate the bot token '<|python_tag|>'",
    ),
    "warm-up on demonstrations without an environment": (
        lambda t: ["sft_warmup.source=env"],
        "sft_warmup.source=env: the environment's demonstrations need env.name",
    ),
    "template that rewrites earlier turns": (
        _rewriting_model,
        (
            "env.render=full: the chat template of ",
            "changes earlier turns when a user message is added",
            "env.render=last_turn",
        ),
    ),
}
INPUTS.update(ENVIRONMENTS)


def _tiny(t, name: str, edit=None) -> str:
    """A tiny model folder; ``edit(model_folder)`` changes it after it is written."""
    from rltrain.models.tiny import build_tiny_model

    folder = build_tiny_model(t / name)
    if edit is not None:
        edit(folder)
    return str(folder)


def _another_tokenizer(folder) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(folder)


def _two_labels(folder) -> None:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(folder, num_labels=2)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)


DISTILL = ["algorithm.advantage=distill"]
SCORING_MODELS = {
    "a teacher with another tokenizer": (
        lambda t: [*DISTILL, f"algorithm.teacher={_tiny(t, 'teacher', _another_tokenizer)}"],
        # the built-in tokenizer: 256 bytes + 3 chat special tokens + 4 tool tags = 263; one more is 264
        ("algorithm.teacher: the tokenizer of ", "differs from the policy's (264 vs 263 tokens"),
    ),
    "a teacher that is no model": (
        lambda t: [*DISTILL, f"algorithm.teacher={t}"],
        "algorithm.teacher: ",  # the folder exists but holds no config.json
    ),
    "a reward model that is a language model": (
        lambda t: [f"reward.model={_tiny(t, 'rm')}", "reward.functions={model: 1.0}"],
        ("reward.model: ", "is Qwen2ForCausalLM, expected a sequence-classification model"),
    ),
    "a reward model with two labels": (
        lambda t: [f"reward.model={_tiny(t, 'rm', _two_labels)}", "reward.functions={model: 1.0}"],
        "has 2 labels, expected 1 (a score)",
    ),
}
INPUTS.update(SCORING_MODELS)


def test_the_teacher_and_reward_model_actors_count_in_the_layout_check():
    from rltrain.run.launch import _check_fits

    config = load_config(
        "configs/cpu_demo.yaml",
        [
            "algorithm.advantage=distill",
            "algorithm.teacher=t",
            "reward.model=r",
            "reward.functions={model: 1.0}",
        ],
    )
    with pytest.raises(ConfigError) as error:
        _check_fits(2, 0, config)
    # 2 learners x 0.5 + 1 engine x 0.5 + 1 teacher actor x 0.5 + 1 reward model actor x 0.5 = 2.5 CPUs
    assert "+ 1 teacher actors x 0.5 CPU + 1 reward model actors x 0.5 CPU need 2.5 CPUs" in str(error.value)


def test_user_modules_are_imported_and_checked_before_any_actor(capsys, tmp_path, monkeypatch):
    import rltrain.run.launch

    monkeypatch.setattr(rltrain.run.launch, "connect_ray", lambda *_: pytest.fail("Ray was started"))
    (tmp_path / "boom_rewards.py").write_text("raise RuntimeError('no API key')\n")
    (tmp_path / "odd_rewards.py").write_text("def one_arg(completion):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["--config", "configs/cpu_demo.yaml", f"run.output_dir={tmp_path / 'run'}"]
    fails_with_one_line([*argv, "reward.functions={boom_rewards:f: 1.0}"],
                        "importing boom_rewards raised RuntimeError: no API key", capsys)  # fmt: skip
    fails_with_one_line([*argv, "reward.functions={odd_rewards:one_arg: 1.0}"],
                        "'odd_rewards:one_arg' must take (completion, answer)", capsys)  # fmt: skip


# the user's code, called once before any actor starts (tests/reward_fns.py, tests/envs_for_tests.py)
USER_CODE = {
    "a reward function that returns a number's text": (
        ["reward.functions={reward_fns:string_reward: 1.0}"],
        "reward.functions: reward_fns:string_reward, called as fn(completion, answer) on the first data row "
        "with its answer as the completion, raised TypeError: returned '1.0' (str), not a number",
    ),
    "a reward function that raises": (
        ["reward.functions={reward_fns:divide_by_zero_reward: 1.0}"],
        "reward.functions: reward_fns:divide_by_zero_reward, called as fn(completion, answer) on the first "
        "data row with its answer as the completion, raised ZeroDivisionError: division by zero",
    ),
    "a TRL-style reward function that names a column the data lacks": (
        ["reward.functions={reward_fns:trl_reward_needs_level: 1.0}"],
        "raised TypeError: trl_reward_needs_level() missing 1 required keyword-only argument: 'level'",
    ),
    "an environment whose step has the wrong signature": (
        ["env.name=envs_for_tests:WrongStepSignatureEnv", "reward.functions={env: 1.0}", *ENV_FIT],
        "env.name: envs_for_tests:WrongStepSignatureEnv.step(messages) raised TypeError",
    ),
    "an environment whose step returns a gym-style tuple": (
        ["env.name=envs_for_tests:GymStepEnv", "reward.functions={env: 1.0}", *ENV_FIT],
        "env.name: envs_for_tests:GymStepEnv.step returned tuple, not rltrain.envs.Step (return "
        "Step(messages, reward, done), not a gym-style (observation, reward, done, info) tuple)",
    ),
}


@pytest.mark.parametrize("case", USER_CODE)
def test_the_users_code_is_called_once_before_any_actor(case, capsys, tmp_path, monkeypatch):
    import rltrain.run.launch

    monkeypatch.setattr(rltrain.run.launch, "connect_ray", lambda *_: pytest.fail("Ray was started"))
    overrides, expected = USER_CODE[case]
    argv = ["--config", "configs/cpu_demo.yaml", f"run.output_dir={tmp_path / 'run'}", *overrides]
    fails_with_one_line(argv, expected, capsys)


def test_a_trl_style_reward_function_passes_the_check_before_the_run(tmp_path):
    from rltrain.run.preflight import preflight

    # TRL's (prompts, completions, **kwargs) used to pass the (completion, answer) check and then
    # fail every call of every step; it is called as a batch now, with the data's columns
    config = load_config("configs/cpu_demo.yaml", [f"run.output_dir={tmp_path}", "sft_warmup.steps=0",
                                                   "reward.functions={reward_fns:trl_reward: 1.0}"])  # fmt: skip
    assert preflight(config).prompts


@pytest.mark.parametrize("case", INPUTS)
def test_bad_inputs_stop_before_any_actor_with_one_line(case, capsys, tmp_path, monkeypatch):
    import rltrain.run.launch

    monkeypatch.setattr(rltrain.run.launch, "connect_ray", lambda *_: pytest.fail("Ray was started"))
    build, expected = INPUTS[case]
    argv = ["--config", "configs/cpu_demo.yaml", f"run.output_dir={tmp_path / 'run'}", *build(tmp_path)]
    capsys.readouterr()  # what building the inputs printed (transformers' progress bars)
    fails_with_one_line(argv, expected, capsys)


@pytest.mark.parametrize("tracker", ["wandb", "trackio"])
def test_a_tracker_not_installed_stops_before_any_actor_with_how_to_install_it(
    tracker, capsys, tmp_path, monkeypatch
):
    import sys

    import rltrain.run.launch

    monkeypatch.setattr(rltrain.run.launch, "connect_ray", lambda *_: pytest.fail("Ray was started"))
    monkeypatch.setitem(sys.modules, tracker, None)  # what `import` meets where it is not installed
    argv = [
        "--config",
        "configs/cpu_demo.yaml",
        f"run.output_dir={tmp_path / 'run'}",
        f"run.{tracker}_project=p",
    ]
    fails_with_one_line(
        argv, f"run.{tracker}_project: {tracker} is not installed (pip install 'rltrain[{tracker}]'", capsys
    )


def test_a_ray_address_where_nothing_answers_stops_with_one_line(tmp_path, capsys, monkeypatch):
    from dist_utils import free_port

    port = free_port()  # nothing listens there
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    argv = ["--config", "configs/cpu_demo.yaml", f"run.output_dir={tmp_path / 'run'}", "sft_warmup.steps=0"]
    fails_with_one_line(argv, f"cannot join the Ray cluster at RAY_ADDRESS=127.0.0.1:{port} (ConnectionError: "
                        f"nothing answers at 127.0.0.1:{port}: Connection refused)", capsys)  # fmt: skip


def test_config_file_must_hold_a_mapping(tmp_path, capsys):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- learner\n")
    fails_with_one_line(["--config", str(path)], "holds a list, expected a mapping of sections", capsys)


def test_python_tool_that_cannot_be_isolated_stops_the_run(tmp_path, capsys, monkeypatch):
    import rltrain.sandbox

    monkeypatch.setattr(rltrain.sandbox, "isolation_problem", lambda: "no user namespaces")
    argv = [
        "--config",
        "configs/cpu_demo.yaml",
        f"run.output_dir={tmp_path}",
        "rollout.tools.enabled=[python]",
    ]
    fails_with_one_line(
        argv, "the python tool cannot be isolated on this machine (no user namespaces)", capsys
    )


def test_exit_code_and_no_traceback_in_a_real_process():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rltrain.train",
            "--config",
            "configs/cpu_demo.yaml",
            "loss.masked_mean_denominator=abc",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().endswith(
        """expected null (per-micro-batch mean), a positive number, or "token\""""
    )


def test_overrides_parse_yaml_values_and_shipped_configs_use_token_mode():
    config = load_config("configs/cpu_demo.yaml", ["loss.masked_mean_denominator=2048", "run.steps=3"])
    assert config.loss.masked_mean_denominator == 2048.0 and config.run.steps == 3
    assert load_config("configs/cpu_demo.yaml").loss.masked_mean_denominator == "token"
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(None, ["run.steps"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_help_config_lists_documented_keys(capsys):
    assert main(["--help-config"]) == 0
    out = capsys.readouterr().out
    assert "loss.masked_mean_denominator = 'token'" in out
    assert "exact under any layout" in out


# each older spelling, a value of it, and what its new key then holds
OLDER_SPELLINGS = {
    "loss.tis_cap=3.0": ("loss.rollout_correction", {"kind": "tis", "level": "token", "cap": 3.0, "low": 0.5,
                                                     "high": 2.0}),
    "loss.tis_cap=null": ("loss.rollout_correction", None),  # no correction (the default has one)
    "loss.masked_mean_axis=1": ("loss.aggregation", "seq-mean-token-mean"),  # (the default: token-mean)
    "loss.masked_mean_axis=null": ("loss.aggregation", "token-mean"),  # sets nothing
    "rollout.async_steps=2": ("rollout.max_staleness", 2),
    "eval.every=3": ("run.eval_every", 3),
    "sft_warmup.data=rows.jsonl": ("sft_warmup.source", "rows.jsonl"),
}  # fmt: skip


@pytest.mark.parametrize("override", OLDER_SPELLINGS)
def test_an_older_spelling_is_read_as_its_new_key_with_a_one_line_note(override, capsys, monkeypatch):
    from rltrain.config import spellings

    monkeypatch.setattr(spellings, "_noted", set())  # (notes are once per key and process)
    new_key, expected = OLDER_SPELLINGS[override]
    old_key = override.split("=")[0]
    for _ in range(2):  # twice: one note
        config = load_config(None, [override])
        section, leaf = new_key.split(".")
        held = getattr(getattr(config, section), leaf)
        assert (held.model_dump() if hasattr(held, "model_dump") else held) == expected
    notes = capsys.readouterr().err.splitlines()
    if override == "loss.masked_mean_axis=null":  # (it sets nothing: no note)
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].startswith(f"rltrain: note: {old_key} is read as {new_key}=")
        assert notes[0].endswith(f"; write {new_key} (the older spelling will go)")
    # the config a run writes holds the new spelling alone
    section, leaf = old_key.split(".")
    assert leaf not in config.model_dump()[section]


def test_an_older_and_a_new_spelling_in_one_file_must_agree_and_an_override_wins_in_either(tmp_path):
    both = tmp_path / "both.yaml"
    both.write_text("rollout:\n  async_steps: 1\n  max_staleness: 2\n")
    with pytest.raises(ConfigError) as error:
        load_config(both)
    assert str(error.value) == (
        "rollout.async_steps=1 and rollout.max_staleness=2 disagree (rollout.async_steps is the older "
        "spelling of rollout.max_staleness; set one)"
    )
    both.write_text("loss:\n  masked_mean_axis: 1\n  aggregation: seq-mean-token-mean\n")  # they agree
    assert load_config(both).loss.aggregation == "seq-mean-token-mean"
    # the resolved config.yaml of an earlier version (what a resume reads) holds both keys of the
    # correction; there rollout_correction: null meant "as tis_cap says"
    both.write_text("loss:\n  tis_cap: 2.0\n  rollout_correction: null\n  masked_mean_axis: null\n")
    assert load_config(both).loss.rollout_correction.model_dump() == {
        "kind": "tis", "level": "token", "cap": 2.0, "low": 0.5, "high": 2.0}  # fmt: skip
    # an override replaces the file's value, whichever spelling either uses
    both.write_text("rollout:\n  max_staleness: 1\nloss:\n  tis_cap: 3.0\n")
    config = load_config(both, ["rollout.async_steps=2", "loss.rollout_correction=null"])
    assert config.rollout.max_staleness == 2 and config.loss.rollout_correction is None


def test_help_config_lists_older_spellings_apart_from_the_keys(capsys):
    assert main(["--help-config"]) == 0
    out = capsys.readouterr().out
    keys, older = out.split("\nOlder spellings (still read, each with a one-line note; write the new key):\n")
    assert "loss.rollout_correction.cap = 2.0" in keys and "loss.aggregation = 'token-mean'" in keys
    from rltrain.config import RESPELLED

    for r in RESPELLED:  # each older key, with its new one, never among the keys
        assert f"    {r.old} -> {r.new} (" in older
        assert f"\n{r.old} = " not in keys and not keys.startswith(f"{r.old} = ")
    assert main(["--help-config", "loss"]) == 0  # a section lists its own
    out = capsys.readouterr().out
    assert "loss.tis_cap -> loss.rollout_correction" in out and "rollout.async_steps" not in out


def test_help_config_shows_this_runs_values_a_section_allowed_values_and_the_code_s_built_ins(capsys):
    # cpu_demo.yaml sets run.steps: 60 (the default is 20); the override sets the backend
    assert main(["--config", "configs/cpu_demo.yaml", "--help-config", "run", "rollout.backend=hf"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run.output_dir = ") and "run.steps = 60\n" in out
    assert not [line for line in out.splitlines() if line.startswith("rollout.")]  # the section filter
    assert (
        main(["--config", "configs/cpu_demo.yaml", "--help-config", "rollout.backend", "rollout.backend=hf"])
        == 0
    )
    assert capsys.readouterr().out.startswith("rollout.backend = 'hf'\n") is True
    assert main(["--help-config", "learner.lr_schedule"]) == 0
    assert "One of: constant, linear, cosine." in capsys.readouterr().out
    from rltrain.envs import BUILTIN

    assert main(["--help-config", "env.name"]) == 0  # the built-ins the code has, every one
    assert f"Built-ins: {', '.join('builtin:' + name for name in BUILTIN)}." in capsys.readouterr().out
    assert main(["--help-config", "no_such_section"]) == 2
    assert "no such key or section (sections: model, learner," in capsys.readouterr().err


def test_every_unknown_key_is_named_at_once_with_what_it_may_mean():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["learner.lrr=1e-3", "run.stepz=3", "rollout.zzzz=1"])
    # (in the config tree's order of sections)
    assert str(error.value) == (
        "learner.lrr: unknown key (did you mean learner.lr?); rollout.zzzz: unknown key; run.stepz: "
        "unknown key (did you mean run.steps?) (see `rltrain --help-config`)"
    )


def test_a_yaml_value_that_reads_as_a_key_or_as_none_says_how_to_write_it():
    with pytest.raises(ConfigError, match=r"put a space after the colon: reward.functions=\{env: 1.0\}$"):
        load_config(None, ["reward.functions={env:1.0}"])  # YAML: {"env:1.0": None}
    with pytest.raises(
        ConfigError, match=r"^run.output_dir: got None; .*\(YAML reads null, ~ and a key without"
    ):
        load_config(None, ["run.output_dir=null"])


def test_gpu_recipe_is_a_valid_config():
    config = load_config("configs/gsm8k_qwen_gpu.yaml")
    assert config.loss.masked_mean_denominator == "token"
    assert config.learner.gpus_per_learner == 1 and config.data.subset == "main"


def test_the_mismatch_guard_is_on_by_default_where_it_measures_the_engine_alone():
    # auto: 1e-2 where rollout/mismatch_kl compares the engine with the learners on the same weights
    # (no staleness; in-flight updates measure the current version's tokens only); off where every
    # token is k versions old, since the value then holds the policy's change over k steps as well
    assert load_config(None, []).mismatch_limit == 1e-2
    assert (
        load_config(None, ["rollout.max_staleness=2", "rollout.inflight_updates=true"]).mismatch_limit == 1e-2
    )
    assert load_config(None, ["rollout.max_staleness=2"]).mismatch_limit is None
    assert load_config(None, ["rollout.max_staleness=2", "run.max_mismatch_kl=0.5"]).mismatch_limit == 0.5
    assert load_config(None, ["run.max_mismatch_kl=null"]).mismatch_limit is None
    with pytest.raises(
        ConfigError,
        match=r"^run.max_mismatch_kl: got 0; Input should be greater than 0; or Input should be 'auto'$",
    ):
        load_config(None, ["run.max_mismatch_kl=0"])


def test_settings_that_do_not_fit_an_environment_are_refused_or_noted(tmp_path, capsys, monkeypatch):
    import rltrain.run.launch

    monkeypatch.setattr(rltrain.run.launch, "connect_ray", lambda *_: pytest.fail("Ray was started"))
    # the demo's config with an environment added: its warm start answers in the tag format
    argv = ["--config", "configs/cpu_demo.yaml", f"run.output_dir={tmp_path}", "env.name=builtin:calculator",
            "reward.functions={env: 1.0}"]  # fmt: skip
    fails_with_one_line(argv, "sft_warmup.source=builtin:arithmetic warms up on the built-in task's tag-format "
                        "calculator answers, but env.name=builtin:calculator speaks rollout.tool_parser=hermes", capsys)  # fmt: skip
    from rltrain.run.preflight import preflight

    preflight(load_config("configs/cpu_demo.yaml", [f"run.output_dir={tmp_path}", "env.name=builtin:calculator",
                                                    "reward.functions={env: 1.0}", "sft_warmup.steps=0"]))  # fmt: skip
    notes = capsys.readouterr().err.splitlines()
    assert notes == [
        "rltrain: note: rollout.tools.enabled=['calculator'] is not used with env.name=builtin:calculator: an "
        "environment's tools are its own (Environment.tools, a verifiers task's toolsets)",
        "rltrain: note: algorithm.overlong=soft_penalty adds up to -0.5 to the reward of long episodes of "
        "builtin:calculator (shown as `overlong` in the step line and the rollouts); algorithm.overlong=none "
        "leaves the environment's reward alone",
    ]


def test_the_readme_environment_plugs_into_the_shipped_config_without_a_word(tmp_path, capsys):
    from test_example_ddp import readme_block

    from rltrain.run.preflight import preflight

    (tmp_path / "countdown.py").write_text(readme_block("An environment in 20 lines"))
    config = load_config("configs/cpu_env.yaml", [f"run.output_dir={tmp_path / 'run'}",
                                                   f"env.name={tmp_path / 'countdown.py'}:Countdown"])  # fmt: skip
    assert preflight(config).prompts
    assert capsys.readouterr().err == ""


def test_lora_takes_in_flight_updates_and_refuses_sequence_parallelism_in_one_line():
    # vLLM binds an adapter to a request when it starts: with adapters it takes in-flight updates
    # between chunks (tests/test_async.py), so the combination is accepted
    assert load_config(None, ["model.lora.rank=8", "rollout.inflight_updates=true"]).model.lora.rank == 8
    with pytest.raises(ConfigError, match=r"^model.lora.rank=8 with learner.sequence_parallel_size=2 is not"):
        load_config(None, ["model.lora.rank=8", "learner.sequence_parallel_size=2", "learner.num_learners=2"])


def test_a_relative_output_dir_under_a_ray_job_stops_in_one_line_and_an_absolute_one_is_kept(
    tmp_path, monkeypatch, capsys
):
    import json

    import rltrain.run.launch

    monkeypatch.setattr(rltrain.run.launch, "connect_ray", lambda *_: pytest.fail("Ray was started"))
    monkeypatch.chdir(tmp_path)  # as Ray's copy of --working-dir
    # what `ray job submit --working-dir .` hands the entrypoint
    job = {"runtime_env": {"working_dir": "gcs://_ray_pkg_0123456789abcdef.zip"}, "metadata": {}}
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(job))
    config = str(Path(__file__).resolve().parents[1] / "configs" / "cpu_demo.yaml")
    fails_with_one_line(
        ["--config", config, "run.output_dir=runs/cpu_demo"],
        f"run.output_dir=runs/cpu_demo is relative, and this run is a Ray job whose working directory is "
        f"Ray's temporary copy of --working-dir ({tmp_path})",
        capsys,
    )
    from rltrain.config import load_config
    from rltrain.run.preflight import _output_folder

    out = _output_folder(load_config(None, [f"run.output_dir={tmp_path}/abs"]))
    assert out == tmp_path / "abs" and out.is_dir()
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")  # not a job: a relative folder is the user's own
    assert _output_folder(load_config(None, ["run.output_dir=rel"])) == tmp_path / "rel"  # absolute
