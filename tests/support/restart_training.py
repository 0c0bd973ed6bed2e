"""A training script run under ``torchrun --max-restarts=1`` by test_restarts: it resumes from
the newest committed checkpoint of a CheckpointManager (if any), trains with dropout, starts an
asynchronous save every ``every`` steps and, at the end, writes each rank's parameters.

With ``kill_at`` > 0, rank 1 kills itself with SIGKILL right after starting the save of step
``kill_at``, on the first attempt only (``flag`` marks that it has happened), so torchrun
restarts the group, which must resume. A watchdog (faulthandler) prints every thread's stack
and ends the process if an attempt hangs.

    python restart_training.py DIRECTORY STEPS EVERY KILL_AT FLAG OUT
"""

import faulthandler
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from resume_training import build, local_parameters, train  # noqa: E402

WATCHDOG_S = 300  # an attempt takes seconds of CPU (a minute or two on a loaded machine); past this it is stuck
TIMEOUT_S = 60  # collectives waiting for a dead or stuck peer give up after this


def main(directory: str, steps: int, every: int, kill_at: int, flag: str, out: str) -> None:
    import autoshard
    from autoshard.checkpoint import CheckpointManager

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    rank, _ = autoshard.init_distributed(timeout=TIMEOUT_S)
    torch.set_num_threads(1)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    # The loop a user writes: resume from the newest committed checkpoint, if any.
    model, optimizer = build()
    manager = CheckpointManager(directory, max_to_keep=2, save_every=every)
    extra = manager.restore(model, optimizer)
    start = 0 if extra is None else extra["step"]
    print(f"rank {rank}: attempt {attempt} starts at step {start}", flush=True)
    for step in range(start, steps):
        train(model, optimizer, range(step, step + 1))
        manager.save(step + 1, model, optimizer, extra={"step": step + 1}, async_save=True)
        if step + 1 == kill_at and rank == 1 and not os.path.exists(flag):
            open(flag, "w").close()
            print(f"rank {rank}: killing itself with a save of step-{step + 1} in flight", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    manager.wait()
    torch.save(local_parameters(model), os.path.join(out, f"rank-{rank}.pt"))
    print(f"rank {rank}: attempt {attempt} finished at step {steps}", flush=True)
    torch.distributed.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6])
