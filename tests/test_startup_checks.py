"""What will fail again stops the run at start-up, in one line, before any work: a model the engine
cannot start (its start-up raised a configuration error: exit 2, no actor restarted), a model the
engine or the learners compute otherwise than the other (the engine's log-probs of a few fixed
sequences against the learners' on the same weights, before the warm start), attention with a mask
of its own making in packed rows (refused by the family contract before any actor)."""

import os
import subprocess
import sys

import families
import pytest
from test_e2e import REPO, SMALL

from rltrain.config import ConfigError, load_config
from rltrain.models.families import layout_problem, needs
from rltrain.models.resolve import check_model


def run(out, *overrides: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rltrain.train", "--config", "configs/cpu_demo.yaml", *SMALL,
                           f"run.output_dir={out}", *overrides], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})  # fmt: skip


def lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith("rltrain:")]


@pytest.mark.slow
def test_an_engine_whose_start_raises_a_configuration_error_stops_the_run_in_one_line_without_restarts(
    tmp_path, ray_cluster
):
    # vLLM's CPU build refuses Granite 4.0's hybrid at its start (a validation error of its config:
    # its Mamba layers' cache needs chunked prefill, which rltrain's CPU engine turns off), the same
    # at every restart; the transformers engine serves it (rollout.backend=hf)
    folder = families.save_moe("granitemoehybrid", tmp_path / "granite")
    done = run(tmp_path / "run", f"model.name_or_path={folder}", "run.steps=1", env=ray_cluster)
    said = lines(done)
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(said) == 1 and said[0].startswith("rltrain: generator 0 died (its start-up raised "), said
    assert "ValidationError: 1 validation error for VllmConfig: " in said[0] and "[type=" not in said[0]
    assert "not restarted (the same settings fail the same way)" in said[0] and "Traceback" not in done.stderr
    assert "restarting every actor" not in done.stderr


@pytest.mark.slow
def test_a_model_the_learners_batch_otherwise_than_alone_stops_at_start_up_before_the_warm_start(
    tmp_path, ray_cluster
):
    # Doge's router views a [batch, tokens, 2K] tensor as [2, batch x tokens, K]: a sequence's log-probs
    # depend on what else is in its batch, so the learners' padded rows are not each sequence alone
    # (the transformers engine's view); the start-up check names the gap and the engine, and the
    # warm start never begins (its load-balancing loss, which no router kind reads, is off: else
    # preflight refuses it first)
    folder = families.save_moe("doge", tmp_path / "doge")
    done = run(tmp_path / "run", f"model.name_or_path={folder}", "rollout.backend=hf", "sft_warmup.steps=5",
               "learner.packing=false", "learner.prefix_sharing=false", "loss.moe_aux_coef=0", env=ray_cluster)  # fmt: skip
    said = lines(done)
    assert done.returncode == 2, done.stderr[-3000:]
    assert (
        len(said) == 1
        and "before any step, on the weights both hold, the engine's (rollout.backend=hf)" in said[0]
    )
    assert "the learners do not run this model exactly in their layout (padded rows)" in said[0], said
    assert not (tmp_path / "run" / "sft_model").exists() and "sft warm-up" not in done.stderr


def test_attention_with_a_mask_of_its_own_making_is_refused_packed_rows_at_start_up_in_one_line(tmp_path):
    # the indexer of DeepSeek-V3.2's sparse attention reads the mask's cells, Doge builds a mask of
    # its own: neither runs on a row without one (packed, a prefix tree); padded rows run them exactly
    # on their own attention (tests/test_moe_families.py)
    for model_type, cls in [("deepseek_v32", "DeepseekV32Attention"), ("doge", "DogeAttention")]:
        model_needs = needs(families.config(model_type), families.build(model_type))
        assert (
            model_needs.own_attention
            == f"attention with a mask of its own making ({cls} reads or builds the mask)"
        )
        assert model_needs.trailing_padding  # (its padding after each sequence, where the mask is its own)
        assert layout_problem(model_needs, "learner", packing=False, sharing="auto") is None
    folder = families.save_moe("deepseek_v32", tmp_path / "deepseek_v32")
    config = load_config("configs/cpu_demo.yaml", [f"model.name_or_path={folder}", "rollout.backend=hf"])
    with pytest.raises(ConfigError) as refused:
        check_model(config, str(folder))
    line = str(refused.value)
    assert "attention with a mask of its own making (DeepseekV32Attention reads or builds the mask)" in line
    assert "set learner.packing=false" in line and "\n" not in line
