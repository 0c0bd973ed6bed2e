"""Ranks that stall, drift or disagree: each is stopped on every rank with an error that names
the cause, instead of a 30-minute hang, a SIGABRT in gloo, or training that silently goes on.

1. a rank that stalls: the others' wait is bounded by the group's timeout
   (init_distributed(timeout=...), 10 minutes by default) and ends in an error naming the
   collective, the forward and the rank that did not arrive;
2. inputs of different shapes: refused before the model's first collective, even with
   check_inputs=False;
3. a rank that skipped opt.step(): its replicated parameters drift, found by the periodic
   replica fingerprint;
4. a gradient that is nan on one rank only: clip_grad_norm_ finds the same non-finite norm
   on every rank (raises on all, or scales all alike).
"""

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import autoshard
from checks import error_text
from hf_models import build
from multirank import run_on_ranks

EVEN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, intermediate_size=128)


def _batch(step: int = 0, rows: int = 2, seq: int = 8):
    return torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(100 + step))


def test_init_distributed_timeout_is_checked():
    with pytest.raises(ValueError, match="init_distributed: timeout must be a positive, finite duration"):
        autoshard.init_distributed(timeout=-1)
    with pytest.raises(ValueError, match="init_distributed: timeout"):
        autoshard.init_distributed(timeout=timedelta(0))
    with pytest.raises(TypeError, match="init_distributed: timeout must be a datetime.timedelta or a number"):
        autoshard.init_distributed(timeout="5m")
    assert autoshard.core.distributed.DEFAULT_TIMEOUT == timedelta(minutes=10)


_TIMEOUT = 5.0


def _stalled():
    rank = dist.get_rank()
    dist.barrier()  # the new group's rendezvous is bounded by its timeout too
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=_TIMEOUT))
    try:
        model = build("llama", seed=0, **EVEN)
        autoshard.parallelize(model, group=group)
        ids = _batch()
        model(input_ids=ids, labels=ids)  # forward 0, every rank
        dist.barrier()
        if rank == dist.get_world_size() - 1:
            # Stalled: alive, but not in the collective, until well after the others' timeout and
            # the 5 s they wait for each other's reports (at exactly that sum, it raced them).
            time.sleep(4 * _TIMEOUT)
        start = time.perf_counter()
        text = error_text(lambda: model(input_ids=ids, labels=ids), RuntimeError)
        return text, time.perf_counter() - start
    finally:
        dist.barrier()
        dist.destroy_process_group(group)


@pytest.mark.parametrize("world_size", [2, 3])
def test_stalled_rank_ends_in_a_named_error_on_every_rank(world_size):
    results = run_on_ranks(_stalled, world_size, timeout=300)
    last = world_size - 1
    for rank, (text, seconds) in enumerate(results):
        print(f"rank {rank} of {world_size}: error after {seconds:.1f}s (timeout {_TIMEOUT}s)")
        assert "the input check's all-gather at forward 1 of the model" in text, text
        assert "init_distributed(timeout=...)" in text, text
        if rank != last:
            assert f"rank(s) [{last}] did not arrive" in text, text


def _shapes(check_inputs: bool):
    rank = dist.get_rank()
    model = build("llama", seed=0, **EVEN)
    autoshard.parallelize(model, check_inputs=check_inputs)
    ids = _batch(rows=2 + rank)
    return error_text(lambda: model(input_ids=ids, labels=ids))


@pytest.mark.parametrize("world_size", [2, 3])
def test_different_batch_shapes_refused_even_without_the_input_check(world_size):
    # Before: with check_inputs=False gloo aborted the process in the model's first all-reduce.
    for text in run_on_ranks(_shapes, world_size, False, timeout=300):
        assert "input 'input_ids' has shape [3, 8] and dtype torch.int64 on rank 1, shape [2, 8]" in text, text
        assert "shapes are compared even with check_inputs=False" in text, text


def _skipped_step(every: int):
    rank = dist.get_rank()
    model = build("llama", seed=0, **EVEN)
    autoshard.parallelize(model, check_replicas_every=every)
    opt = autoshard.optim.AdamW(model.parameters(), lr=1e-3)
    found = []
    for step in range(4):
        ids = _batch(step)
        text = error_text(lambda: model(input_ids=ids, labels=ids).loss.backward(), RuntimeError)
        if text != "no error":
            found.append((step, text))
            break
        if not (step == 0 and rank == 1):  # rank 1 skips its first step
            opt.step()
        opt.zero_grad()
    return found


def test_rank_that_skipped_a_step_is_found_by_the_replica_fingerprint():
    for found in run_on_ranks(_skipped_step, 2, 2, timeout=300):
        assert found and found[0][0] == 2, found  # checked at forwards 0, 2, ...
        text = found[0][1]
        assert "the replicated parameter 'model.layers.0.input_layernorm.weight' differs" in text, text
        assert "at forward 2" in text and "skipped opt.step()" in text, text
    for found in run_on_ranks(_skipped_step, 2, 0, timeout=300):  # off: training goes on, drifted
        assert found == [], found


def test_check_replicas_every_is_checked():
    with pytest.raises(TypeError, match="parallelize: check_replicas_every must be an int >= 0"):
        autoshard.parallelize(build("llama", seed=0, **EVEN), check_replicas_every=-1)


def _nan_on_one_rank():
    rank = dist.get_rank()
    model = build("llama", seed=0, **EVEN)
    autoshard.parallelize(model)
    ids = _batch()
    model(input_ids=ids, labels=ids).loss.backward()
    if rank == 1:
        model.model.norm.weight.grad[0] = float("nan")
    clipped = error_text(lambda: autoshard.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True),
                         RuntimeError)
    total = autoshard.runtime.clip.global_grad_norm(list(model.parameters()))
    inf_total = autoshard.runtime.clip.global_grad_norm(list(model.parameters()), float("inf"))
    return clipped, float(total), float(inf_total)


@pytest.mark.parametrize("world_size", [2, 3])
def test_nan_in_a_replicated_gradient_on_one_rank_gives_every_rank_the_same_norm(world_size):
    for clipped, total, inf_total in run_on_ranks(_nan_on_one_rank, world_size, timeout=300):
        assert "clip_grad_norm_: the total norm of order 2.0 is nan" in clipped, clipped
        assert total != total and inf_total == float("inf"), (total, inf_total)
