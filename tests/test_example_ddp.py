"""The README's DDP snippet (examples/ddp_token_mean.py) gives the single-process token-mean update."""

import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import ddp_token_mean as example  # noqa: E402
from dist_utils import free_port  # noqa: E402


def test_readme_ddp_example_equals_single_process_token_mean():
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(example.train_step, args=(2, free_port(), out), nprocs=2, join=True)
        weights = dict(out)

    # reference: one process, every micro-batch of both ranks, (sum of masked squares) / (token count)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = example.micro_batches_of(0) + example.micro_batches_of(1)
    per_token = [model(x).squeeze(-1) ** 2 * mask for x, mask in batches]
    count = sum(mask.sum() for _, mask in batches)
    (sum(t.sum() for t in per_token) / count).backward()
    optimizer.step()

    for rank in (0, 1):
        for ours, ref in zip(weights[rank], model.parameters()):
            torch.testing.assert_close(ours, ref.detach(), rtol=1e-6, atol=1e-7)
