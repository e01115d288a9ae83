"""Shared test set-up: keep thread counts small on 2-core machines."""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
