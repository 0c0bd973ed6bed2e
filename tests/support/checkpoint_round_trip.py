"""One AdamW step on a parallelized model, saved as a checkpoint, and the checkpoint loaded into
a freshly built model (sharded or not): the whole state each side holds, for tests that a
checkpoint saved at one world size reloads at another. `build` is a module-level function (the
ranks import it) that builds the same model from the same seed every time."""

from typing import Callable

import torch

import autoshard


def ids(step: int, vocab: int = 101) -> torch.Tensor:
    return torch.randint(1, vocab, (2, 8), generator=torch.Generator().manual_seed(step))


def train_and_save(path: str, build: Callable, *args) -> dict:
    model = autoshard.parallelize(build(*args))
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=1e-2)
    batch = ids(0)
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    autoshard.checkpoint.save(path, model, optimizer)
    return {n: v.clone() for n, v in autoshard.full_state_dict(model).items()}


def load(path: str, build: Callable, *args, sharded: bool = True) -> dict:
    torch.manual_seed(1)
    model = build(*args)
    for p in model.parameters():
        torch.nn.init.normal_(p)  # other weights than the checkpoint's
    if sharded:
        autoshard.parallelize(model)
    autoshard.checkpoint.load(path, model)
    return {n: v.clone() for n, v in (autoshard.full_state_dict(model) if sharded else model.state_dict()).items()}
