"""One rank of test_checkpoint's killed-save test, started as its own process: saves step-1,
adds 1 to every parameter, starts an asynchronous save of step-2 and waits to be killed.
With argv[2] == "1", rank 1's writer is held back, so that the save cannot commit."""

import importlib
import os
import sys
import time

import torch

import autoshard
from autoshard import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checkpoint_models import build_toy, parallelize_toy  # noqa: E402


def main(directory: str, slow_writer: bool) -> None:
    rank, _ = autoshard.init_distributed()
    torch.set_num_threads(1)
    model = parallelize_toy(build_toy(0))
    checkpoint.save(os.path.join(directory, "step-1"), model, extra={"step": 1})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model.temperature.add_(1.0)
    if slow_writer and rank == 1:
        save_module = importlib.import_module("autoshard.checkpoint.save")  # the module, not the function
        write = save_module.write_safetensors

        def stalled(*args, **kwargs):
            time.sleep(3600)
            return write(*args, **kwargs)

        save_module.write_safetensors = stalled
    checkpoint.save(os.path.join(directory, "step-2"), model, extra={"step": 2}, async_save=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] == "1")
