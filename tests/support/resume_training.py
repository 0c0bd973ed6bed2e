"""Training with dropout, stopped, saved and resumed, for the exact-resume test.

The model draws dropout masks on each rank for the rank's own shard of a column-parallel layer's
output (uneven at 2 and 3 ranks, so the ranks draw different amounts there, from the region's
generator), and each batch is chosen with Python's ``random`` and numpy's global generator. ``uninterrupted`` trains ``k + m``
steps in one go; ``first_part`` trains ``k`` steps and saves; this file, run as a script on
every rank of a fresh job, loads that checkpoint, trains ``m`` more steps and writes what it
got (run once with the saved generator states and once without, as a control).
"""

import os
import random
import sys

import numpy as np
import torch
from torch import nn

VOCAB = 37
SEED = 1234


class DropoutToy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 20)
        self.up = nn.Linear(20, 31)
        self.drop_hidden = nn.Dropout(0.3)
        self.down = nn.Linear(31, 20)
        self.norm = nn.LayerNorm(20)
        self.head = nn.Linear(20, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(self.drop_hidden(torch.relu(self.up(h))))
        return self.head(self.norm(h))


def _ids(step: int) -> torch.Tensor:
    base = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(900 + step))
    return (base + random.randrange(VOCAB) + int(np.random.randint(VOCAB))) % VOCAB


def build(seed: int = SEED):
    """A fresh process's start: every generator seeded, the model parallelized, its optimizer."""
    import autoshard

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = DropoutToy()
    plan = autoshard.plan(model, world_size=torch.distributed.get_world_size(), example_inputs=(_ids(0),))
    model = autoshard.parallelize(model, plan)
    return model, autoshard.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, optimizer, steps: range) -> list:
    losses = []
    model.train()
    for step in steps:
        ids = _ids(step)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.roll(1, 1).flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().clone())
    return losses


def local_parameters(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def uninterrupted(k: int, m: int):
    """Run in a job's ranks: k + m steps without a stop; (losses of the last m, parameters)."""
    model, optimizer = build()
    losses = train(model, optimizer, range(k + m))
    return losses[k:], local_parameters(model)


def first_part(path: str, k: int) -> None:
    """Run in a job's ranks: k steps, then a save (asynchronous, as a training loop would)."""
    from autoshard import checkpoint

    model, optimizer = build()
    train(model, optimizer, range(k))
    checkpoint.save(path, model, optimizer, extra={"step": k}, async_save=True).wait()


def resume(path: str, m: int, restore_rng: bool):
    from autoshard import checkpoint

    model, optimizer = build(seed=SEED + 1)  # a new job seeds anew; the checkpoint must bring the states
    k = checkpoint.load(path, model, optimizer, restore_rng=restore_rng)["step"]
    return train(model, optimizer, range(k, k + m)), local_parameters(model)


def main(path: str, m: int, out: str) -> None:
    import autoshard

    rank, _ = autoshard.init_distributed()
    torch.set_num_threads(1)
    restored = resume(path, m, restore_rng=True)  # first, in the fresh process
    control = resume(path, m, restore_rng=False)
    torch.save({"restored": restored, "control": control}, os.path.join(out, f"rank-{rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
