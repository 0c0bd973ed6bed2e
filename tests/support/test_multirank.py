import os
import time

import pytest
import torch
import torch.distributed as dist

from multirank import RankFailure, run_on_ranks


def _all_reduce_rank():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _pid():
    return os.getpid()


def _worker_env():
    return os.environ.get("AUTOSHARD_TEST_WORKER"), os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on purpose")
    return dist.get_rank()


def _unpicklable_result():
    return lambda: None


def _rank_0_waits_alone():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))  # the other ranks never join
    return dist.get_rank()


def _exit_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_reduce_indexed_by_rank(world_size):
    results = run_on_ranks(_all_reduce_rank, world_size)
    expected = world_size * (world_size + 1) / 2
    assert results == [(r, world_size, expected) for r in range(world_size)]


def test_pool_is_reused_and_workers_are_configured():
    first = run_on_ranks(_pid, 2)
    second = run_on_ranks(_pid, 2)
    assert first == second
    assert len(set(first)) == 2 and os.getpid() not in first
    assert run_on_ranks(_worker_env, 2) == [("1", "1", 1)] * 2


def test_failure_names_rank_and_next_call_gets_fresh_pool():
    pids = run_on_ranks(_pid, 2)
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_raise_on_rank_1, 2)
    message = str(info.value)
    assert "rank 1 raised" in message and "rank 0" not in message
    assert "ValueError: boom on purpose" in message
    assert "_raise_on_rank_1" in message  # the remote traceback, not just the text
    assert set(info.value.failures) == {1}
    new_pids = run_on_ranks(_pid, 2)
    assert set(new_pids).isdisjoint(pids)


def test_unpicklable_return_value_is_a_rank_failure():
    with pytest.raises(RankFailure, match="could not be pickled") as info:
        run_on_ranks(_unpicklable_result, 2)
    assert set(info.value.failures) == {0, 1}
    assert run_on_ranks(_all_reduce_rank, 2) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_hang_times_out_and_next_call_works():
    run_on_ranks(_pid, 2)  # pool start-up must not count against the short timeout
    start = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_on_ranks(_rank_0_waits_alone, 2, timeout=3)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "2 ranks" in message and "_rank_0_waits_alone" in message
    assert message.endswith("rank(s) 0")
    assert run_on_ranks(_all_reduce_rank, 2) == [(0, 2, 3.0), (1, 2, 3.0)]


def test_dead_worker_is_reported_promptly():
    run_on_ranks(_pid, 2)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_on_ranks(_exit_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 10
    assert "rank 1 died" in str(info.value)
    assert "exited with code 3" in info.value.failures[1]
    assert set(info.value.failures) == {1}
