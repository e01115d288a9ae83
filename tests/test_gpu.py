"""The same exactness checks on NVIDIA GPUs (NCCL between learners, CUDA vLLM). Marked `gpu`: skipped
by default and in CI; run with `pytest -m gpu` on a machine with at least 2 GPUs."""

import pytest
import torch

from rltrain.diagnostics import (
    layout_config,
    relative_difference,
    synthetic_rollouts,
    update_after_one_step,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs"),
]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_token_mode_layout_invariance_over_nccl(zero_stage, ray_local, tiny_model_path):
    # fp32 on GPU so that the comparison is as tight as on CPU
    gpu = {"gpus_per_learner": 1, "cpus_per_learner": 1, "precision": "fp32"}
    batch = synthetic_rollouts()
    one = update_after_one_step(layout_config(1, 2, zero_stage, **gpu), tiny_model_path, batch)
    two = update_after_one_step(layout_config(2, 3, zero_stage, **gpu), tiny_model_path, batch)
    naive_one = update_after_one_step(layout_config(1, 2, zero_stage, None, **gpu), tiny_model_path, batch)
    naive_two = update_after_one_step(layout_config(2, 3, zero_stage, None, **gpu), tiny_model_path, batch)
    assert relative_difference(two, one) < 1e-5
    assert relative_difference(naive_two, naive_one) > 1e-2
