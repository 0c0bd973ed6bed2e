"""Clear errors, raised before anything changes, where a mistake used to crash: ranks that built
different models, parallelizing twice, a partial load_pretrained, absurd split arguments and a
stray CommCounter.__exit__."""


import numpy as np
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

import autoshard
from autoshard.state.state_views import unwrap_shard_views
from checkpoint_models import TiedToy, build_toy, toy_ids
from multirank import run_on_ranks


def _parallelize_what_this_rank_built(variant: str):
    """Rank 1 builds another model; returns the error parallelize raised (None: it passed)."""
    torch.manual_seed(0)
    model = TiedToy()
    if dist.get_rank() == 1:
        if variant == "dtype":
            model = model.double()
        elif variant == "shape":
            model.up, model.down = torch.nn.Linear(20, 32), torch.nn.Linear(32, 20)
    try:
        autoshard.parallelize(model, autoshard.plan(model, world_size=2, example_inputs=(toy_ids(0),)))
    except ValueError as error:
        return str(error), all(not hasattr(m, "shard_specs") for m in model.modules())
    return None, None


@pytest.mark.parametrize("variant,words", [
    ("dtype", ["rank 1", "'embed.weight'", "torch.float64", "torch.float32"]),
    ("shape", ["rank 1", "'up.weight'", "[32, 20]", "[30, 20]"]),
])
def test_ranks_that_built_different_models_fail_on_every_rank(variant, words):
    results = run_on_ranks(_parallelize_what_this_rank_built, 2, variant)
    for message, unchanged in results:
        assert message is not None and all(w in message for w in words), (message, words)
        assert unchanged
    # The same model on both ranks still passes (and the check costs nothing else).
    assert run_on_ranks(_parallelize_what_this_rank_built, 2, "same") == [(None, None)] * 2


def _parallelize_twice(with_plan: bool):
    model = build_toy(0)
    plan = autoshard.plan(model, world_size=2, example_inputs=(toy_ids(0),))
    autoshard.parallelize(model, plan)
    # Each rank's own tensors (the state dict shows sharded ones with their global shapes).
    before = {k: v.clone() for k, v in unwrap_shard_views(model.state_dict()).items()}
    try:
        autoshard.parallelize(model, plan if with_plan else None)
    except ValueError as error:
        unchanged = all(torch.equal(before[k], v) for k, v in unwrap_shard_views(model.state_dict()).items())
        return str(error), unchanged
    return None, None


@pytest.mark.parametrize("with_plan", [True, False])
def test_parallelize_on_a_parallelized_model_says_so(with_plan):
    for message, unchanged in run_on_ranks(_parallelize_twice, 2, with_plan):
        assert message is not None and "already parallelized" in message, message
        assert unchanged


def test_load_pretrained_strict_false_refuses_before_changing_the_model(tmp_path):
    source = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    save_file({"0.weight": source[0].weight.detach().contiguous(), "0.bias": source[0].bias.detach().contiguous()},
              str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 3))
    with pytest.raises(RuntimeError, match=r"1\.weight.*left unchanged"):
        autoshard.load_pretrained(model, tmp_path / "model.safetensors", strict=False, progress=False)
    assert all(t.device.type == "meta" for t in model.parameters())
    # With the missing layer given real tensors, the same call loads what the file holds.
    model[1].to_empty(device="cpu")
    autoshard.load_pretrained(model, tmp_path / "model.safetensors", strict=False, progress=False)
    assert torch.equal(model[0].weight, source[0].weight) and torch.equal(model[0].bias, source[0].bias)


def test_absurd_section_counts_are_refused_before_allocating():
    x = torch.arange(10.0)
    for call in (lambda: autoshard.array_split(x, 2**40), lambda: autoshard.split_sizes(10, 2**40),
                 lambda: torch.ops.autoshard.array_split(x, 2**40)):
        with pytest.raises(ValueError, match="sections must be at most"):
            call()
    # A world larger than the tensor is fine for one rank's piece, with no list of every piece.
    sizes = [len(p) for p in np.array_split(np.arange(10), 1000)]
    for rank, world in ((3, 2**40), (20, 2**40), (999, 1000), (0, 1000)):
        start = sum(sizes[:rank]) if world == 1000 else min(rank, 10)
        length = sizes[rank] if world == 1000 else int(rank < 10)
        assert torch.equal(autoshard.shard(x, rank, world), x[start:start + length])


@pytest.mark.parametrize("call,argument", [
    (lambda x: autoshard.array_split(x, [2, 2**64]), "sections_or_indices"),
    (lambda x: autoshard.array_split(x, 2**64), "sections_or_indices"),
    (lambda x: autoshard.array_split(x, [-(2**63) - 1]), "sections_or_indices"),
    (lambda x: autoshard.split_sizes(2**64, 3), "length"),
    (lambda x: autoshard.shard(x, 2**64, 4), "rank"),
    (lambda x: autoshard.array_split(x, 2, dim=2**64), "dim"),
])
def test_indices_beyond_int64_name_the_argument(call, argument):
    with pytest.raises(ValueError, match="must fit in a signed 64-bit integer") as caught:
        call(torch.arange(10.0))
    assert argument in str(caught.value)


def _count_after_a_stray_exit():
    counter = autoshard.CommCounter()
    try:
        counter.__exit__(None, None, None)
        stray = None
    except RuntimeError as error:
        stray = str(error)
    with counter:
        autoshard.comm.reduce_from_parallel(torch.ones(4))
    with counter:
        autoshard.comm.reduce_from_parallel(torch.ones(4))
    return stray, counter.counts


def test_a_stray_comm_counter_exit_is_refused_and_counting_goes_on():
    for stray, counts in run_on_ranks(_count_after_a_stray_exit, 2):
        assert stray is not None and "without a matching __enter__" in stray
        assert counts == {"all_reduce": 2}, counts
