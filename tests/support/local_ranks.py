"""Ranks started by hand on this machine, outside run_on_ranks' pools (the benchmarks' ranks,
and tests whose ranks must be processes of their own): a free port for their rendezvous and
the environment torch.distributed reads for each rank."""

import socket
from typing import Dict


def free_port() -> int:
    """A TCP port on 127.0.0.1 that no one listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(port: int, rank: int, world: int) -> Dict[str, str]:
    """MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE of `rank` in a world of `world` ranks that
    meet at 127.0.0.1:`port`."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world)}
