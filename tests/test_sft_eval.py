"""Warm start and held-out evaluation: data, the SFT loss on the learners' path, scoring, curves."""

import json
import re
import subprocess
import sys

import pytest
import torch
from test_e2e import REPO, run_trainer
from transformers import AutoTokenizer

from rltrain.batch import Completion
from rltrain.config import Config, DataConfig, EvalConfig, SFTWarmupConfig
from rltrain.curves import PANELS, panels_for, plot_curves
from rltrain.data import arithmetic_rows, sft_examples, split_held_out, tokenize_completion
from rltrain.diagnostics import (
    layout_config,
    relative_difference,
    synthetic_rollouts,
    updates_after_one_step,
)
from rltrain.envs import ChainEnv, tool_schemas
from rltrain.episodes.chat import with_call_ids
from rltrain.rewards.functions import RewardScorer
from rltrain.run.eval import evaluate
from rltrain.run.tracking import Tracker, eval_table


def test_held_out_questions_are_never_training_questions(tmp_path):
    rows = arithmetic_rows()
    train, held = split_held_out(rows, DataConfig(), EvalConfig(num_prompts=64))
    assert train == rows and len(held) == 64
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    # a data file: its last rows are held out and leave training
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    train, held = split_held_out(
        [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)],
        DataConfig(source=str(path)),
        EvalConfig(num_prompts=3),
    )
    assert [r["prompt"] for r in held] == ["q7", "q8", "q9"] and len(train) == 7
    with pytest.raises(ValueError, match="would leave none"):
        split_held_out(train[:2], DataConfig(source=str(path)), EvalConfig(num_prompts=3))


def test_warm_up_examples_and_their_tool_masks(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = [{"prompt": "What is 12 + 30? Answer with the number.", "answer": "42"}] * 200
    examples = sft_examples(SFTWarmupConfig(tool_fraction=0.25), rows, seed=0)
    calls = [e["completion"] for e in examples if e["completion"].startswith("<tool:")]
    assert 30 < len(calls) < 70  # ~25% of 200
    assert calls[0] == "<tool:calculator>12 + 30</tool><result>42</result> 42"
    # a direct answer starts as the call's last words do: its first token (" ") says "answer now"
    assert {e["completion"] for e in examples} - set(calls) == {" 42"}
    ids, mask = tokenize_completion(calls[0], tokenizer)
    # byte-level tokenizer: one token per character; tool mask 0 exactly on <result>42</result>
    call, result = len("<tool:calculator>12 + 30</tool>"), len("<result>42</result>")
    assert mask == [1] * call + [0] * result + [1] * len(" 42") + [1]  # + EOS
    assert (
        ids[-1] == tokenizer.eos_token_id
        and tokenizer.decode(ids[call : call + result]) == "<result>42</result>"
    )


def test_copy_examples_are_given_the_calls_opening_tag_and_leave_the_first_token_untrained(tiny_model_path):
    from rltrain.run.warm_start import encode_examples

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    rows = [{"prompt": "What is 12 + 30? Answer with the number.", "answer": "42"}] * 400
    sft = SFTWarmupConfig(tool_fraction=0.25, copy_fraction=0.5)
    examples = sft_examples(sft, rows, seed=0)
    given = [e for e in examples if "given" in e]
    trained_first = [e["completion"][0] for e in examples if "given" not in e]
    assert 160 < len(given) < 240  # ~50% of 400
    # the others split as without copy examples: ~25% calls, so the first token's choice is unmoved
    assert 0.15 < trained_first.count("<") / len(trained_first) < 0.35
    assert given[0] == {"prompt": rows[0]["prompt"], "given": "<tool:calculator>",
                        "completion": "12 + 30</tool><result>42</result> 42"}  # fmt: skip
    config = Config(data=DataConfig(source="builtin:arithmetic"))
    (prompt, ids, mask), (plain, _, _) = encode_examples([given[0], {"prompt": rows[0]["prompt"],
                                                          "completion": " 42"}], tokenizer, config)  # fmt: skip
    # byte-level: the tag's 17 characters end the prompt (untrained); the completion starts after it
    assert prompt == plain + tokenizer.encode("<tool:calculator>", add_special_tokens=False)
    assert len("<tool:calculator>") == len(prompt) - len(plain) == 17
    assert tokenizer.decode(ids[:7]) == "12 + 30" and mask.count(0) == len("<result>42</result>")


def test_a_file_of_openai_format_conversations_warms_up_on_what_the_environment_demonstrates(tmp_path):
    import importlib.util

    from rltrain.data import sft_conversations
    from rltrain.episodes.chat import render_conversations
    from rltrain.models.tiny import build_tokenizer
    from rltrain.run.warm_start import demonstrations

    spec = importlib.util.spec_from_file_location(
        "chain_demos", REPO / "examples" / "chain_demonstrations.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    config = Config.model_validate(
        {
            "env": {"name": "builtin:chain", "kwargs": {"high": 300, "tool_fraction": 0.5}},
            "sft_warmup": {"source": "env"},
        }
    )
    rows = [{"prompt": "chain", "answer": str(n)} for n in range(12)]
    tokenizer = build_tokenizer()
    expected = demonstrations(config, rows, tokenizer)  # the environment's warm start
    assert any(
        sum(1 for t in ids if t == tokenizer.convert_tokens_to_ids("<tool_call>")) for _, ids, _ in expected
    )
    # the same conversations as an agent's log: OpenAI's format, arguments as JSON strings, call ids
    path = tmp_path / "demos.jsonl"
    with path.open("w") as f:
        for row in rows:
            env = ChainEnv(**config.env.kwargs)
            messages = with_call_ids(env.demonstration(row))
            f.write(
                json.dumps(
                    {
                        "messages": [example.openai_format(m) for m in messages],
                        "tools": tool_schemas(ChainEnv.tools),
                    }
                )
                + "\n"
            )
    assert '"arguments": "{\\"expression\\"' in path.read_text()  # a JSON string, as the client sends
    assert render_conversations(sft_conversations(str(path)), tokenizer) == expected
    prompt, ids, mask = expected[0]
    learned = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert "<tool_response>" in tokenizer.decode(ids) and "<tool_response>" not in learned  # tool output: 0
    # prompt/completion files and built-ins are not conversations; a bad conversation names its line
    (tmp_path / "pc.jsonl").write_text('{"prompt": "1+1?", "completion": "2"}\n')
    assert (
        sft_conversations(str(tmp_path / "pc.jsonl")) is None and sft_conversations("builtin:chain") is None
    )
    for line, problem in [
        ({"messages": [{"role": "user", "content": "hi"}]}, "line 2: no assistant message"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "line 2: message 0 has role 'robot'"),
        ({"messages": [{"role": "assistant", "content": "hi"}], "tools": "calculator"}, "line 2: `tools` must be a list"),
    ]:  # fmt: skip
        path.write_text(
            json.dumps({"messages": [{"role": "assistant", "content": "ok"}]}) + "\n" + json.dumps(line)
        )
        with pytest.raises(ValueError, match=re.escape(f"sft_warmup.source: demos.jsonl {problem}")):
            sft_conversations(str(path))


def test_a_conversation_the_template_cannot_render_stops_the_warm_start_naming_it(tmp_path):
    from rltrain.models.tiny import build_tokenizer
    from rltrain.run.warm_start import BadExamples, warm_start

    tokenizer = build_tokenizer()  # with a Qwen3-like template: earlier assistant turns lose their text
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "{{ message.content or '' }}",
        "{{ '' if messages[loop.index0 + 1:] | selectattr('role', 'equalto', 'user') | list else message.content }}",
    )
    one_turn = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    path = tmp_path / "demos.jsonl"  # eight that render (preflight's sample), then a second turn
    lines = [{"messages": one_turn}] * 8 + [{"messages": [*one_turn, {"role": "user", "content": "+1?"},
                                                          {"role": "assistant", "content": "5"}]}]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = Config.model_validate({"sft_warmup": {"steps": 1, "source": str(path)}})
    with pytest.raises(
        BadExamples, match=r"sft_warmup.source '.*demos.jsonl': conversation 9: .*changes earlier turns"
    ):
        warm_start(config, "unused: it stops before any learner", [], tokenizer, tmp_path)


class ScriptedPool:
    """Stands in for GeneratorPool: greedy requests get scripted completions."""

    def __init__(self, texts):
        self.texts, self.greedy = texts, []

    def submit(self, prompts, seeds, greedy=False):
        self.greedy.append(greedy)
        return list(range(len(prompts)))

    def collect(self, refs):
        return [Completion(token_ids=[1] * len(t), text=t, tool_calls=int("<tool:" in t)) for t in self.texts]


def test_evaluate_scores_greedy_completions_with_math_verify():
    from rltrain.data import Prompt

    prompts = [Prompt(i, [1, 2], answer) for i, answer in enumerate(["42", "7", "13", "5"])]
    pool = ScriptedPool(
        ["<tool:calculator>40+2</tool><result>42</result> 42", "The answer is 7", "12", "five"]
    )
    with RewardScorer({"math": 1.0}, timeout_s=10) as scorer:
        metrics = evaluate(pool, prompts, scorer)
    assert pool.greedy == [True]
    # correct: 42 (after the tool), 7; wrong: 12, "five" -> 2 / 4; one of four called a tool
    assert metrics["eval/accuracy"] == 0.5 and metrics["eval/tool_call_rate"] == 0.25


def test_held_out_accuracy_counts_full_credit_only_where_the_scorer_gives_partial_credit():
    from rltrain.config import DataConfig
    from rltrain.data import Prompt, load_rows

    data = DataConfig(source="reasoning_gym:chain_sum", size=4, seed=0,
                      task_config={"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2})  # fmt: skip
    rows = load_rows(data)
    prompts = [Prompt(i, [1, 2], row["answer"]) for i, row in enumerate(rows)]
    right = [json.loads(row["answer"])["answer"] for row in rows]
    texts = [right[0], right[1], f"x{right[2]}", "0.5"]  # two right, one near miss, one wrong
    with RewardScorer({"reasoning_gym": 1.0}, timeout_s=10) as scorer:
        metrics = evaluate(ScriptedPool(texts), prompts, scorer, functions={"reasoning_gym": 1.0})
    # chain_sum's scorer gives an answer that contains the right one len(right)/len(answer): "x76"
    # for 76 earns 2/3
    near = len(right[2]) / (len(right[2]) + 1)
    assert metrics["eval/reward/reasoning_gym"] == pytest.approx((1 + 1 + near + 0) / 4)
    assert metrics["eval/accuracy"] == 0.5  # full credit only: 2 of 4


def test_curves_draw_every_panel(tmp_path):
    rows = [{"step": s, "reward/mean": s / 10, "reward/math": s / 20, "eval/accuracy": s / 30, "train/kl": 0.01,
             "train/entropy": 1.0, "train/clip_fraction": 0.1, "rollout/length_mean": 5.0, "time/generate_s": 0.2,
             "time/train_s": 0.1, "time/sync_s": 0.02, "train/pg_loss": 0.0} for s in range(1, 4)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_curves(tmp_path / "metrics.jsonl", tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    titles = [title for title, _ in PANELS]
    for wanted in ["held-out (greedy)", "reward", "response length (tokens)", "entropy", "KL to the reference",
                   "clip fraction", "step time (s)"]:  # fmt: skip
        assert wanted in titles


def test_a_ppo_runs_curves_add_the_critics_values_returns_and_explained_variance(tmp_path):
    from PIL import Image

    base = {"reward/mean": 0.5, "train/pg_loss": 0.0, "time/train_s": 0.1}
    critic = {"critic/value_mean": 0.4, "critic/return_mean": 0.5, "critic/explained_variance": 0.2}
    widths = {}
    for name, extra in [("grpo", {}), ("ppo", critic)]:
        rows = [{"step": s, **base, **extra} for s in range(1, 4)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        plot_curves(tmp_path / f"{name}.jsonl", tmp_path / f"{name}.png")
        widths[name] = Image.open(tmp_path / f"{name}.png").size[0]
        titles = [title for title, _ in panels_for(rows)]
        assert ("critic explained variance" in titles) == bool(extra)
    series = dict(panels_for([{"step": 1, **critic}]))["critic: value and return (token means)"]
    assert [key for key, _ in series] == ["critic/value_mean", "critic/return_mean"]
    # 8 panels in 4 columns of 4 inches, 10 in 5: 16 and 20 inches at 90 dpi
    assert widths == {"grpo": 16 * 90, "ppo": 20 * 90}, widths


def test_an_environments_held_out_success_is_what_the_table_and_the_curves_show():
    rows = [{"step": s, "eval/success": s / 10, "eval/tool_call_rate": 0.5, "eval/turns": 2.0,
             "eval/response_length": 100.0} for s in (0, 5)]  # fmt: skip
    table = eval_table(rows).splitlines()
    assert table[1].split() == ["success", "0.0%", "50.0%"]  # 0 / 10 and 5 / 10
    assert table[3].split() == ["turns", "2.00", "2.00"]
    held_out = dict(PANELS)["held-out (greedy)"]
    assert ("eval/success", "success") in held_out and ("eval/accuracy", "accuracy") in held_out
    task = eval_table([{"step": 0, "eval/accuracy": 0.5, "eval/tool_call_rate": 0.0}] * 2).splitlines()
    assert task[1].split() == ["accuracy", "50.0%", "50.0%"]


def test_the_step_line_shows_what_the_held_out_set_is_scored_by_and_tools_only_where_there_are(
    tmp_path, capsys
):
    from rltrain.config import load_config

    tools = load_config(None, ["rollout.tools.enabled=[calculator]"])
    (tmp_path / "env").mkdir()
    (tmp_path / "own").mkdir()
    with Tracker(tmp_path / "env", tools, start_step=0) as tracker:
        tracker.log(5, {"eval/success": 0.5, "eval/tool_call_rate": 1.0})
    assert "held-out success 50% (tool 100%)" in capsys.readouterr().out
    # a run without tools, scored by its own reward function (no correctness function among them)
    rows = [{"eval/reward": r, "eval/reward/mine:f": r, "eval/tool_call_rate": 0.0} for r in (0.25, 0.75)]
    with Tracker(tmp_path / "own", Config(), start_step=0) as tracker:
        tracker.log(0, rows[0], advance=False)
        tracker.log(5, rows[1])
    out = capsys.readouterr().out
    assert "step 5/20 held-out reward 0.750\n" in out and "tool" not in out
    # the closing table: the weighted reward and each function, no tool-call row
    assert [line.split() for line in out.splitlines()[-3:]] == [
        ["held-out", "(greedy)", "step", "0", "step", "5"], ["reward", "0.250", "0.750"],
        ["reward", "mine:f", "0.250", "0.750"]]  # fmt: skip


@pytest.mark.slow
def test_sft_update_is_layout_invariant_in_token_mode(ray_local, kept_learners, tiny_model_path):
    from rltrain.learner.sft import SFTLearner

    batch = synthetic_rollouts()  # tool tokens (masked out of the loss) and an all-masked sequence
    reference, split, packed, naive_one, naive_split = updates_after_one_step(
        [layout_config(1, 8, 0), layout_config(2, 3, 2), layout_config(2, 1, 2, max_tokens_per_micro_batch=16),
         layout_config(1, 8, 0, None), layout_config(2, 3, 2, None)], tiny_model_path, batch, SFTLearner,
    )  # fmt: skip
    assert relative_difference(split, reference) < 1e-5
    assert relative_difference(packed, reference) < 1e-5
    assert relative_difference(naive_split, naive_one) > 1e-2
    assert any(v.abs().sum() > 0 for v in reference.values())


@pytest.mark.slow
def test_warm_start_then_held_out_evaluation_and_rltrain_eval(tmp_path, ray_cluster):
    out = tmp_path / "run"
    common = ["sft_warmup.steps=20", "run.eval_every=2", "eval.num_prompts=8", "rollout.max_new_tokens=48",
              "run.checkpoint_every=0"]  # fmt: skip
    # a weight group that cannot form (no member joins within a millisecond): said in one line, and
    # the run goes on through the object store
    done = run_trainer(out, *common, "run.steps=3", "rollout.weight_sync_timeout_s=0.001", env=ray_cluster)
    fallback = [line for line in done.stderr.splitlines() if "rollout.weight_sync=collective" in line]
    assert len(fallback) == 1 and fallback[0].startswith("rltrain: note: rollout.weight_sync=collective could not "
                                                         "be set up ("), done.stderr[-2000:]  # fmt: skip
    assert "the weights go through the object store" in fallback[0]
    assert "sft warm-up: 20 steps" in done.stderr + done.stdout
    # a log file, not a terminal: no progress-bar frames (their rate reads "step/s"), and the warm-up
    # reports every fifth of the way (20 // 5 = 4 steps)
    assert "step/s" not in done.stderr + done.stdout
    assert "sft warm-up: step 4/20" in done.stdout and "sft warm-up: step 16/20" in done.stdout
    assert "WARNING" not in done.stderr and "Warning" not in done.stderr, done.stderr[-2000:]
    assert json.loads((out / "sft_model" / "rltrain_sft.json").read_text())["loss"][0] > 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2, 3]  # start, every 2, end
    assert "held-out (greedy)" in done.stdout  # the before/after table
    # (that a resumed run reuses the warmed-up model: tests/test_resume.py, the PPO config's resume)
    last = rows[-1]
    # scoring the final model apart gives what the run logged at its end (same prompts, greedy)
    scored = subprocess.run([sys.executable, "-m", "rltrain.run.eval", "--model", str(out / "final_model"), "--config",
                             "configs/cpu_demo.yaml", *common[2:4], "run.ray_num_cpus=2"],
                            cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert scored.returncode == 0, scored.stderr[-3000:]
    result = json.loads(scored.stdout.strip().splitlines()[-1])
    for key in ["eval/accuracy", "eval/tool_call_rate", "eval/response_length"]:
        assert result[key] == pytest.approx(last[key]), key
    assert torch.isfinite(torch.tensor(result["eval/accuracy"]))


def test_a_reasoning_gym_task_trains_and_is_evaluated_by_its_own_scorer(tmp_path, ray_cluster):
    out = tmp_path / "run"
    done = run_trainer(out, "data.source=reasoning_gym:chain_sum", "data.size=64", "rollout.backend=hf",
                       "data.task_config={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
                       "data.max_prompt_tokens=200", "reward.functions={reasoning_gym: 1.0}",
                       "rollout.tools.enabled=[]", "sft_warmup.steps=0", "run.steps=1", "run.eval_every=1",
                       "eval.num_prompts=4", "run.checkpoint_every=0", env=ray_cluster)  # fmt: skip
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # held-out accuracy is the dataset's own score_answer (a correctness function), before and after
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1], done.stdout[-2000:]
    assert 0.0 <= rows[-1]["eval/accuracy"] <= 1.0 and "reward/reasoning_gym" in rows[-1]


def test_the_cached_warm_start_is_redone_when_its_loss_aggregation_changes():
    from rltrain.config import Config
    from rltrain.run.warm_start import _settings

    plain = Config()
    per_sequence = Config.model_validate({"loss": {"aggregation": "seq-mean-token-mean"}})
    # the warm-up's loss follows loss.aggregation: another aggregation trains another model
    assert _settings(plain, "m") != _settings(per_sequence, "m")
    assert _settings(plain, "m") == _settings(Config(), "m")


def test_every_learner_and_loss_setting_that_shapes_the_warm_start_is_in_its_cache_key():
    from rltrain.config import Config, load_config
    from rltrain.run.warm_start import _settings

    base = _settings(Config(), "m")
    for override in ["learner.optimizer=sgd", "learner.betas=[0.9, 0.95]", "learner.max_grad_norm=0.5",
                     "learner.precision=bf16", "learner.weight_decay=0.1", "loss.masked_mean_denominator=null",
                     "learner.micro_batch_size=2"]:  # fmt: skip
        assert _settings(load_config(None, [override]), "m") != base, override  # another model: not reused
    # a vision tower trained (model.freeze_vision=false) trains another model
    assert _settings(load_config(None, ["model.freeze_vision=false"]), "m") != base
    # what Ray reserves changes nothing that is trained: the cached model is reused
    for override in ["learner.cpus_per_learner=1", "learner.placement=SPREAD"]:
        assert _settings(load_config(None, [override]), "m") == base, override
    # outside token mode a micro-batch's mean weighs its own tokens: sharing, which plans a group's
    # tree whole, changes which sequences travel together, and so the update
    naive = ["loss.masked_mean_denominator=null"]
    assert _settings(load_config(None, [*naive, "learner.prefix_sharing=false"]), "m") != _settings(
        load_config(None, naive), "m"
    )


def test_settings_that_leave_the_warmed_up_model_as_it_is_reuse_it_and_a_copy_fraction_that_does_not_apply_is_noted(
    tmp_path, capsys
):
    from rltrain.config import load_config
    from rltrain.run.preflight import preflight
    from rltrain.run.warm_start import _settings

    demo = ["sft_warmup.steps=10"]
    base = _settings(load_config("configs/cpu_demo.yaml", demo), "m")
    # sharing a prompt's forward (checked to give the same outputs) and RL's prompt draws
    for override in ["learner.prefix_sharing=false", "data.difficulty_sampling={}"]:
        assert _settings(load_config("configs/cpu_demo.yaml", [*demo, override]), "m") == base, override
    # the built-in task's example mix shapes its examples, and another source's not at all
    assert (
        _settings(load_config("configs/cpu_demo.yaml", [*demo, "sft_warmup.copy_fraction=0.2"]), "m") != base
    )
    examples = tmp_path / "examples.jsonl"
    examples.write_text('{"prompt": "What is 1 + 2?", "completion": "3"}\n')
    written = [*demo, f"sft_warmup.source={examples}"]
    assert _settings(
        load_config("configs/cpu_demo.yaml", [*written, "sft_warmup.copy_fraction=0.2"]), "m"
    ) == (_settings(load_config("configs/cpu_demo.yaml", [*written, "sft_warmup.copy_fraction=0"]), "m"))
    # the demo's copy_fraction (0.6) with a file of examples: one line at start-up says it is not used
    capsys.readouterr()
    preflight(load_config("configs/cpu_demo.yaml", [*written, f"run.output_dir={tmp_path / 'run'}"]))
    notes = [line for line in capsys.readouterr().err.splitlines() if "copy_fraction" in line]
    assert len(notes) == 1 and notes[0].startswith("rltrain: note: sft_warmup.copy_fraction=0.6 applies to")


def test_the_warm_starts_learning_rate_schedule_reaches_its_learners_and_its_cache_key():
    from rltrain.config import Config
    from rltrain.learner.sft import SFTLearner
    from rltrain.run.warm_start import _settings

    decaying = Config.model_validate({"sft_warmup": {"steps": 750, "lr_schedule": "linear"}})
    # the learners' scheduler is built from this section, over sft_warmup.steps optimizer steps
    assert SFTLearner.section(decaying).lr_schedule == "linear"
    assert SFTLearner.section(decaying).warmup_steps == 0
    assert SFTLearner.section(Config()).lr_schedule == "constant"
    assert _settings(decaying, "m") != _settings(
        Config.model_validate({"sft_warmup": {"steps": 750}}), "m"
    )  # another schedule trains another model: a cached constant-rate warm start is not reused


def test_a_full_fine_tuning_warm_start_under_lora_is_the_one_a_run_without_lora_has():
    from rltrain.config import Config
    from rltrain.run.warm_start import _settings

    plain = Config()
    adapters = Config.model_validate({"model": {"lora": {"rank": 8}}})
    full = Config.model_validate({"model": {"lora": {"rank": 8}}, "sft_warmup": {"lora": False}})
    # sft_warmup.lora=false trains every weight: the same model as without LoRA, reused from its cache
    assert _settings(full, "m") == _settings(plain, "m") != _settings(adapters, "m")


def test_held_out_completions_are_scored_by_the_runs_own_reward_functions(tmp_path):
    from rltrain.config import load_config
    from rltrain.data import Prompt

    # a task of the user's own (the word reversed), with its own reward: math-verify would score 0
    (tmp_path / "reverse.py").write_text("def reverse_reward(c, a):\n    return float(c.strip() == a)\n")
    spec = f"{tmp_path}/reverse.py:reverse_reward"
    config = load_config(None, [f"reward.functions={{{spec}: 1.0}}"])
    assert config.eval_functions == {spec: 1.0}  # the run's own, by default
    prompts = [Prompt(i, [1, 2], answer) for i, answer in enumerate(["olleh", "dlrow", "tac", "god"])]
    pool = ScriptedPool(["olleh", "dlrow", "cat", "god"])  # 3 of 4 right
    with RewardScorer(config.eval_functions, timeout_s=10) as scorer:
        metrics = evaluate(pool, prompts, scorer, functions=config.eval_functions)
    assert metrics["eval/reward"] == 0.75 and metrics["eval/reward/reverse:reverse_reward"] == 0.75
    assert "eval/accuracy" not in metrics  # no correctness function among them
    # eval.reward_functions overrides them; math among them gives eval/accuracy (0 here: words)
    both = load_config(
        None, [f"reward.functions={{{spec}: 1.0}}", f"eval.reward_functions={{{spec}: 2.0, math: 1.0}}"]
    )
    with RewardScorer(both.eval_functions, timeout_s=10) as scorer:
        metrics = evaluate(
            ScriptedPool(["olleh", "dlrow", "cat", "god"]), prompts, scorer, functions=both.eval_functions
        )
    assert metrics["eval/reward"] == 1.5 and metrics["eval/accuracy"] == 0.0  # 2.0 * 0.75 + 1.0 * 0
    # a reward model's and a judge's score are left out unless eval.model_rewards says so
    judged = load_config(
        None, ["reward.functions={math: 1.0, judge: 1.0}", "reward.judge={max_new_tokens: 8}"]
    )
    assert judged.eval_functions == {"math": 1.0}
    assert load_config(None, ["reward.functions={math: 1.0, judge: 1.0}", "reward.judge={max_new_tokens: 8}",
                              "eval.model_rewards=true"]).eval_functions == {"math": 1.0, "judge": 1.0}  # fmt: skip
