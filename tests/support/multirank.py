"""Run a function on N gloo ranks held in reusable, spawned worker pools.

Spawning a process and importing torch costs seconds, so each world size keeps
one pool of ranks alive for the whole session. A pool is thrown away only after
a job on it failed, hung or lost a worker: its surviving ranks may then be stuck
inside a collective, waiting for a peer that will never come.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "run_on_ranks", "shutdown_pools"]

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# Starting a pool means importing torch in every rank on a possibly busy box.
_START_TIMEOUT = 120.0
# After one rank failed, how long to wait for the others so all failures get reported.
_GRACE = 2.0
# Set before the children start so it is in place before they import torch.
_WORKER_ENV = {"OMP_NUM_THREADS": "1", "AUTOSHARD_TEST_WORKER": "1"}
_STOP = b"stop"


class RankFailure(RuntimeError):
    """One or more ranks raised or died; ``failures`` maps rank -> remote traceback text."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures


def _answer(conn, status: str, value) -> None:
    try:
        data = pickle.dumps((status, value))
    except Exception:
        data = pickle.dumps(("err", f"return value of type {type(value).__name__} could not be "
                                    f"pickled:\n{traceback.format_exc()}"))
    conn.send_bytes(data)


def _worker_main(rank: int, world_size: int, port: int, conn) -> None:
    if _TESTS_DIR not in sys.path:
        sys.path.insert(0, _TESTS_DIR)
    try:
        torch.set_num_threads(1)  # up to 4 ranks share very few cores
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=timedelta(seconds=_START_TIMEOUT))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    except BaseException:
        _answer(conn, "err", traceback.format_exc())
        return
    _answer(conn, "ok", os.getpid())
    try:
        while True:
            try:
                msg = conn.recv_bytes()
            except EOFError:
                return  # the parent is gone
            if msg == _STOP:
                return
            try:
                # Pools outlive test modules, so pick up sys.path entries added since the spawn.
                paths, call = pickle.loads(msg)
                sys.path.extend(p for p in paths if p not in sys.path)
                fn, args, kwargs = pickle.loads(call)
                status, value = "ok", fn(*args, **kwargs)
            except BaseException:
                status, value = "err", traceback.format_exc()
            _answer(conn, status, value)
    finally:
        dist.destroy_process_group()


class _Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        # Port 0 lets the OS pick a free port: no race between concurrent runs.
        # The parent keeps the master store alive for as long as the pool lives.
        self.store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                                   wait_for_workers=False)
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        saved = {k: os.environ.get(k) for k in _WORKER_ENV}
        os.environ.update(_WORKER_ENV)
        try:
            for rank in range(world_size):
                parent_conn, child_conn = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, daemon=True,
                                   name=f"rank{rank}of{world_size}",
                                   args=(rank, world_size, self.store.port, child_conn))
                proc.start()
                # Drop our copy of the child's end so a dead worker reads as EOF.
                child_conn.close()
                self.procs.append(proc)
                self.conns.append(parent_conn)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        answers, failures, missing = self.collect(_START_TIMEOUT)
        if failures or missing:
            self.kill()
            _raise(f"starting {world_size} ranks", failures, missing, _START_TIMEOUT)
        self.pids = [answers[r] for r in range(world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def collect(self, timeout: float):
        """Wait for one answer per rank.

        Returns (answers, failures as rank -> (verb, text), ranks that never answered)."""
        answers, failures = {}, {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            handles = {}
            for r in pending:
                # Waiting on the sentinel too notices a dead worker at once.
                handles[self.conns[r]] = handles[self.procs[r].sentinel] = r
            for ready in wait(list(handles), left):
                r = handles[ready]
                if r not in pending:
                    continue
                pending.discard(r)
                try:
                    status, value = pickle.loads(self.conns[r].recv_bytes())
                except (EOFError, OSError):
                    self.procs[r].join(1)
                    status, value = "died", (f"its worker process exited with code "
                                             f"{self.procs[r].exitcode} without answering\n")
                except Exception:
                    status, value = "failed", ("its answer could not be unpickled in the parent:\n"
                                               + traceback.format_exc())
                if status == "ok":
                    answers[r] = value
                else:
                    failures[r] = ("raised" if status == "err" else status, value)
                    deadline = min(deadline, time.monotonic() + _GRACE)
        return answers, failures, sorted(pending)

    def ask_to_stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(_STOP)
            except OSError:
                pass

    def kill(self) -> None:
        # SIGKILL: a rank blocked inside a gloo collective will not react to anything gentler.
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5.0)
        for conn in self.conns:
            conn.close()


def _raise(where: str, failures: dict, missing: list[int], timeout: float):
    silent = ", ".join(map(str, missing))
    if failures:
        parts = [f"rank {r} {verb}:\n{text}" for r, (verb, text) in sorted(failures.items())]
        if missing:
            parts.append(f"(rank(s) {silent} did not answer)")
        raise RankFailure(f"{where}: " + "\n".join(parts),
                          {r: text for r, (_, text) in failures.items()})
    raise TimeoutError(f"{where}: no answer within {timeout}s from rank(s) {silent}")


_pools: dict[int, _Pool] = {}


def run_on_ranks(fn, world_size: int, *args, timeout: float = 120.0, **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` ranks that already have a gloo default
    process group initialised (torch.distributed.get_rank()/get_world_size() work inside fn).
    Returns the list of per-rank return values, index = rank."""
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
    # Pickled here so that an unpicklable fn or argument fails in the parent, before any rank runs.
    job = pickle.dumps((list(sys.path), pickle.dumps((fn, args, kwargs))))
    pool = _pools.get(world_size)
    if pool is not None and not pool.alive():
        pool.kill()
        pool = None
    if pool is None:
        pool = _pools[world_size] = _Pool(world_size)
    for conn in pool.conns:
        try:
            conn.send_bytes(job)
        except OSError:
            pass  # the dead worker is reported by collect() through its sentinel
    answers, failures, missing = pool.collect(timeout)
    if failures or missing:
        del _pools[world_size]
        pool.kill()
        _raise(f"fn {name} on {world_size} ranks", failures, missing, timeout)
    return [answers[r] for r in range(world_size)]


def shutdown_pools() -> None:
    """Stop every pool; safe to call more than once."""
    pools = list(_pools.values())
    _pools.clear()
    # Ask every pool first so that all workers wind down in parallel.
    for pool in pools:
        pool.ask_to_stop()
    deadline = time.monotonic() + 5.0
    for pool in pools:
        for proc in pool.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        pool.kill()


atexit.register(shutdown_pools)
