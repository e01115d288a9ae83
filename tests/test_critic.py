"""The critic on real Ray actors and DeepSpeed engines: its update is layout-invariant in `token`
mode (and not per micro-batch), checkpoints round-trip, the Hugging Face export loads."""

import pytest
import torch
from transformers import AutoModelForTokenClassification

from rltrain.critic import CriticLearner
from rltrain.diagnostics import (
    critic_layout_config,
    relative_difference,
    synthetic_rollouts,
    update_after_one_step,
    with_value_targets,
)
from rltrain.learner import LearnerGroup
from rltrain.logprobs import token_outputs

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_critic_update_is_layout_invariant_in_token_mode(zero_stage, ray_local, tiny_model_path):
    # 8 sequences with tool tokens and an all-masked one; random returns and rollout-time values
    batch = with_value_targets(synthetic_rollouts())
    reference = update_after_one_step(critic_layout_config(1, 8, 0), tiny_model_path, batch, CriticLearner)
    layouts = {
        "2 learners x micro-batches of 3": critic_layout_config(2, 3, zero_stage),
        "2 learners, packed under 16 tokens": critic_layout_config(
            2, 1, zero_stage, max_tokens_per_micro_batch=16
        ),
    }
    diffs = {
        name: relative_difference(update_after_one_step(c, tiny_model_path, batch, CriticLearner), reference)
        for name, c in layouts.items()
    }
    naive_one = update_after_one_step(
        critic_layout_config(1, 8, 0, None), tiny_model_path, batch, CriticLearner
    )
    naive_split = update_after_one_step(
        critic_layout_config(2, 3, zero_stage, None), tiny_model_path, batch, CriticLearner
    )
    naive = relative_difference(naive_split, naive_one)
    print(f"critic, ZeRO-{zero_stage}: token mode {diffs}; per-micro-batch mode {naive:.3e}")
    assert max(diffs.values()) < 1e-5, diffs
    assert naive > 1e-2, naive


def test_critic_checkpoint_round_trip_and_export(ray_local, tiny_model_path, tmp_path):
    config = critic_layout_config(2, 2, 2, optimizer="adamw", lr=1e-2, warmup_steps=2, lr_schedule="linear")
    first, second = (
        with_value_targets(synthetic_rollouts(seed=1), 1),
        with_value_targets(synthetic_rollouts(seed=2), 2),
    )
    group = LearnerGroup(config, tiny_model_path, total_optimizer_steps=4, learner_cls=CriticLearner)
    try:
        group.train_step(first)
        group.save_checkpoint(tmp_path, "step1", {"step": 1})
        group.save_hf(tmp_path / "critic_hf")
        exported_values = group.per_token(second)
        group.train_step(second)
        uninterrupted = group.state_dict()
    finally:
        group.shutdown()

    fresh = LearnerGroup(config, tiny_model_path, total_optimizer_steps=4, learner_cls=CriticLearner)
    try:
        assert fresh.load_checkpoint(tmp_path, "step1") == {"step": 1}
        metrics = fresh.train_step(second)
        resumed = fresh.state_dict()
    finally:
        fresh.shutdown()
    # 1 of 2 warm-up steps done: lr 1e-2 * 1/2
    assert metrics["critic/lr"] == pytest.approx(5e-3)
    for name in uninterrupted:
        torch.testing.assert_close(resumed[name], uninterrupted[name], rtol=0, atol=1e-7)
    # the export loads with transformers and predicts what the learners predicted
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic_hf")
    with torch.no_grad():
        out = token_outputs(model, second.input_ids, second.attention_mask)[..., 0]
    expected = torch.nn.functional.pad(out[:, :-1], (1, 0))  # values[:, t]: the state before token t
    keep = second.attention_mask.bool()
    torch.testing.assert_close(exported_values[keep], expected[keep], rtol=1e-5, atol=1e-5)
