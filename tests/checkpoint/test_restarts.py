"""A job under ``torchrun --max-restarts=1`` whose rank is killed with an asynchronous save in
flight resumes from the newest committed checkpoint, within a time bound, and ends bitwise
equal to the uninterrupted run (dropout on: each rank's generators are restored)."""

import os
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from autoshard.core import distributed
from local_ranks import free_port, torchrun_command

SUPPORT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
SCRIPT = os.path.join(SUPPORT_DIR, "restart_training.py")
STEPS, EVERY, KILL_AT = 8, 2, 6
BOUND_S = 600  # per torchrun: generous for a loaded machine, far below a hang (torch's 30-minute timeout)


def _run(directory, out, kill_at: int, max_restarts: int) -> str:
    os.makedirs(directory)
    os.makedirs(out)
    command = torchrun_command(SCRIPT, directory, STEPS, EVERY, kill_at, os.path.join(out, "killed"), out,
                               max_restarts=max_restarts)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=BOUND_S, env=env)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    print(f"torchrun took {time.monotonic() - started:.1f} s")
    return log


def _parameters(out) -> list:
    return [torch.load(os.path.join(out, f"rank-{r}.pt")) for r in range(2)]


def test_a_rank_killed_during_an_async_save_restarts_and_ends_bitwise_equal(tmp_path):
    _run(tmp_path / "plain", tmp_path / "plain-out", kill_at=0, max_restarts=0)
    log = _run(tmp_path / "killed", tmp_path / "killed-out", kill_at=KILL_AT, max_restarts=1)
    assert "killing itself with a save of step-6 in flight" in log, log
    # The restarted group resumed from a committed checkpoint (step-4, or step-6 if its save
    # committed before the kill), not from the start.
    resumed = {int(rank): int(step) for rank, step in re.findall(r"rank (\d): attempt 1 starts at step (\d+)", log)}
    assert sorted(resumed) == [0, 1] and len(set(resumed.values())) == 1, log
    assert resumed[0] in (4, 6), log
    expected, got = _parameters(tmp_path / "plain-out"), _parameters(tmp_path / "killed-out")
    for rank in range(2):
        assert expected[rank].keys() == got[rank].keys()
        differ = [name for name in expected[rank] if not torch.equal(expected[rank][name], got[rank][name])]
        assert differ == [], f"rank {rank}: {differ}"
    assert sorted(os.listdir(tmp_path / "killed")) == ["step-6", "step-8"]  # max_to_keep=2; no .partial left


def test_each_attempt_of_a_torchrun_gets_its_own_keys_in_the_agents_store(monkeypatch):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert distributed._restart_store(distributed.DEFAULT_TIMEOUT) is None  # env:// as usual
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    for attempt in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        distributed._restart_store(distributed.DEFAULT_TIMEOUT).set("rank_0", f"address of attempt {attempt}")
    # The dead attempt's key is still in the shared store; the new attempt's is another key.
    assert server.get("autoshard/attempt-0/rank_0") == b"address of attempt 0"
    assert server.get("autoshard/attempt-1/rank_0") == b"address of attempt 1"
