"""The critic on real Ray actors and DeepSpeed engines: its update is layout-invariant in `token`
mode (and not per micro-batch), the Hugging Face export loads (checkpoint round trips:
tests/test_learner.py)."""

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


def test_exported_critic_loads_with_transformers_and_predicts_the_same_values(
    ray_local, tiny_model_path, tmp_path
):
    batch = with_value_targets(synthetic_rollouts(seed=1), 1)
    group = LearnerGroup(critic_layout_config(2, 2, 2, lr=1e-2), tiny_model_path, total_optimizer_steps=1,
                         learner_cls=CriticLearner)  # fmt: skip
    try:
        group.train_step(batch)  # the head leaves 0, so the values below are not trivially equal
        group.save_hf(tmp_path / "critic_hf")
        values = group.per_token(batch)
    finally:
        group.shutdown()
    model = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic_hf")
    with torch.no_grad():
        out = token_outputs(model, batch.input_ids, batch.attention_mask)[..., 0]
    expected = torch.nn.functional.pad(out[:, :-1], (1, 0))  # values[:, t]: the state before token t
    keep = batch.attention_mask.bool()
    assert expected[keep].abs().max() > 0
    torch.testing.assert_close(values[keep], expected[keep], rtol=1e-5, atol=1e-5)
