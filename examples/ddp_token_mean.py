"""Exact token-mean loss in your own DDP loop: 2 ranks x 2 accumulation steps, uneven lengths.

Run: python examples/ddp_token_mean.py   (spawns 2 gloo processes on CPU)
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from rltrain.masked_mean import group_token_totals, masked_mean

ACCUMULATION_STEPS = 2


def micro_batches_of(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches: features [B, T, 4] and a loss mask [B, T] (padding/tool tokens 0)."""
    g = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(2, 5, 4, generator=g), torch.rand(2, 5, generator=g) > 0.3 * (i + rank))
        for i in range(ACCUMULATION_STEPS)
    ]


def train_step(rank: int, world_size: int, port: int, weights_out: dict | None = None) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    micro_batches = micro_batches_of(rank)

    # 1. one collective: loss tokens of the whole optimizer step, over all micro-batches and ranks
    (total_tokens,) = group_token_totals([mask for _, mask in micro_batches], ACCUMULATION_STEPS)
    for i, (x, mask) in enumerate(micro_batches):
        per_token_loss = model(x).squeeze(-1) ** 2  # [B, T]
        # 2. token sum / global total, x world_size because DDP *averages* gradients over ranks;
        #    no "/ ACCUMULATION_STEPS": total_tokens already counts every micro-batch
        loss = masked_mean(per_token_loss, mask, denominator=total_tokens / world_size)
        with model.no_sync() if i < ACCUMULATION_STEPS - 1 else torch.enable_grad():
            loss.backward()
    optimizer.step()
    if rank == 0:
        print(f"step done: {int(total_tokens)} loss tokens in the step, weight {model.module.weight.data}")
    if weights_out is not None:
        weights_out[rank] = [p.detach().clone() for p in model.module.parameters()]
    # tear down in order: DDP's reducer holds the group, so free it first; then no rank leaves the
    # group while another is still in it (gloo can abort a process on either)
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(train_step, args=(2, free_port()), nprocs=2)
