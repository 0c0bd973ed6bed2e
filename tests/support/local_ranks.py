"""Ranks started by hand on this machine, outside run_on_ranks' pools (the benchmarks' ranks,
and tests whose ranks must be processes of their own): a free port for their rendezvous, the
environment torch.distributed reads for each rank, and a script started under torchrun as a
user starts it."""

import os
import socket
import subprocess
import sys
from typing import Dict, List


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(port: int, rank: int, world: int) -> Dict[str, str]:
    """MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE of `rank` in a world of `world` ranks that
    meet at 127.0.0.1:`port`."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)}


def torchrun_command(script, *args, ranks: int = 2, max_restarts: int = 0) -> List[str]:
    """The command that runs `script` with `args` under torchrun on `ranks` local processes,
    restarting the group at most `max_restarts` times when a rank fails."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            f"--max-restarts={max_restarts}", str(script), *map(str, args)]


def run_under_torchrun(script, *args, cwd=None, timeout: float = 600) -> str:
    """Runs `script` with `args` under torchrun on 2 local processes of one thread each; fails
    with everything it printed unless it succeeds, and returns its standard output."""
    result = subprocess.run(torchrun_command(script, *args), capture_output=True, text=True, timeout=timeout,
                            cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout
