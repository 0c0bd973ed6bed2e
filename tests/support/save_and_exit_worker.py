"""One rank of the exit test, started as its own process: saves a checkpoint and lets the
interpreter exit, as a short training script does. argv: directory, how it ends:

- "wait": an asynchronous save, waited for; the process group is left to the interpreter;
- "destroy": the same, then ``torch.distributed.destroy_process_group()``;
- "in_flight": an asynchronous save not waited for (the interpreter's exit finishes it);
- "race": a save to ``directory/ckpt`` that another job may be saving to at the same moment
  (the error it may get is printed, and the process exits 0).
"""

import os
import sys

import torch
import torch.distributed as dist

import autoshard
from autoshard import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_models import build_toy, parallelize_toy  # noqa: E402


def main(directory: str, how: str) -> None:
    autoshard.init_distributed()
    torch.set_num_threads(1)
    model = parallelize_toy(build_toy(0))
    optimizer = autoshard.optim.AdamW(model.parameters(), lr=1e-2)
    if how == "race":
        try:
            checkpoint.save(os.path.join(directory, "ckpt"), model, optimizer, async_save=True).wait()
            print("committed")
        except (checkpoint.CheckpointSaveError, FileExistsError) as error:
            print(f"refused: {error}")
        return
    handle = checkpoint.save(os.path.join(directory, "step-1"), model, optimizer, async_save=True)
    if how in ("wait", "destroy"):
        handle.wait()
    if how == "destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
