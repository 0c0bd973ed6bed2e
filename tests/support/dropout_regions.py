"""Rank functions for dropout inside and after a sharded region at an uneven split."""

import torch
from torch import nn

import autoshard

HEADS, HEAD_DIM, HIDDEN = 10, 4, 12


class Block(nn.Module):
    """An attention-like column layer (10 heads of 4) with dropout on its output, a row layer,
    then dropout on the replicated output."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, HEADS * HEAD_DIM)
        self.inner = nn.Dropout(0.5)
        self.down = nn.Linear(HEADS * HEAD_DIM, HIDDEN)
        self.outer = nn.Dropout(0.5)

    def forward(self, x):
        return self.outer(self.down(self.inner(self.up(x))))


def replicated_outputs(steps: int = 3):
    """The outputs of the replicated region (after the outer dropout) at each of `steps` forwards,
    with the column layer split on whole heads (4, 3, 3 at 3 ranks), on this rank."""
    torch.manual_seed(0)
    block = Block().train()
    block.up = autoshard.nn.ColumnParallelLinear.from_linear(block.up, units=HEAD_DIM)
    block.down = autoshard.nn.RowParallelLinear.from_linear(block.down, units=HEAD_DIM)
    torch.manual_seed(1)  # the same generator state on every rank
    x = torch.ones(2, HIDDEN)
    return [block(x).detach() for _ in range(steps)]
