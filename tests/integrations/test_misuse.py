"""Misuse of a parallelized model, caught at its first step with an error that names the tool
and what to do instead, on every rank: DDP or FSDP over the tensor-parallel ranks, FSDP1 over
the data-parallel ones (FSDP2 there is exact: test_fsdp2), and inputs
that differ across them. What is legitimate stays exact against the unsharded model: DDP over
the "dp" dimension of a 2 x 2 mesh, the same inputs on every rank, the input check turned off,
activation checkpointing and torch.compile (no graph break) with the checks on.

The Llama here has even shards at 2 ranks (hidden 64, 4 heads over 2 KV heads, vocabulary
256): DDP's own check of the parameters' shapes passes, so that only autoshard can catch it.
"""

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.state.state_views import unwrap_shard_views
from autoshard.core.distributed import set_default_group
from gathered import gathered_grads
from hf_models import build
from checks import error_text
from multirank import run_on_ranks

EVEN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, intermediate_size=128)
ALTERNATIVE = ("mesh.get_group('dp')", "parallelize(model, mesh=mesh)", "Trainer")


def _batch(step: int = 0, rows: int = 2, seq: int = 8):
    return torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(100 + step))


class _Holder(torch.nn.Module):
    """A module around the model: DDP wrapping it never reads the model's own attributes."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs)


def _ddp_over_tensor_parallel(around: bool):
    from torch.nn.parallel import DistributedDataParallel

    model = build("llama", seed=0, **EVEN)
    autoshard.parallelize(model)
    # Each rank's own tensors (the state dict shows sharded ones with their global shapes).
    before = {k: v.clone() for k, v in unwrap_shard_views(model.state_dict()).items()}
    refused = error_text(lambda: DistributedDataParallel(model))
    unchanged = all(torch.equal(before[k], v) for k, v in unwrap_shard_views(model.state_dict()).items())
    at_forward = None
    if around:  # constructed, and its broadcast done: caught at the first forward
        wrapped = DistributedDataParallel(_Holder(model))
        at_forward = error_text(lambda: wrapped(input_ids=_batch(), labels=_batch()))
    return refused, unchanged, at_forward


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_over_tensor_parallel_ranks_is_refused(world_size):
    for refused, unchanged, at_forward in run_on_ranks(_ddp_over_tensor_parallel, world_size, world_size == 2,
                                                       timeout=600):
        for text in [refused] + ([at_forward] if world_size == 2 else []):
            assert "DistributedDataParallel spans ranks" in text, text
            assert all(words in text for words in ALTERNATIVE), text
        assert "refused before its first broadcast" in refused
        assert unchanged, "the refused DDP changed the model"
        if world_size == 2:
            assert "build and parallelize the model again" in at_forward


def _fsdp1_stand_in(model):
    """Stands for FullyShardedDataParallel(model), which needs a GPU to be built: an instance
    of its class over the world's group, left unbuilt, whose forward calls the model, as
    FSDP's does."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    stand_in = torch.nn.Module.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(stand_in)
    stand_in._fsdp_wrapped_module = model
    stand_in.process_group = dist.group.WORLD
    stand_in.forward = lambda **inputs: model(**inputs)
    return stand_in


def _fsdp_over_tensor_parallel():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    ids = _batch()
    errors = {}
    model = build("llama", seed=0, **EVEN)
    autoshard.parallelize(model)
    errors["FullyShardedDataParallel"] = error_text(lambda: _fsdp1_stand_in(model)(input_ids=ids, labels=ids))
    world = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build("llama", seed=0, **EVEN)
    autoshard.parallelize(model)
    # fully_shard itself refuses, at its first look at a shard, before it replaces any parameter.
    errors["fully_shard"] = error_text(lambda: fully_shard(model, mesh=world))
    layers = build("llama", seed=0, **EVEN)  # layer by layer, the model itself left out
    autoshard.parallelize(layers)
    errors["fully_shard (layers)"] = error_text(lambda: [fully_shard(layer, mesh=world)
                                                         for layer in layers.model.layers])
    return errors


def test_fsdp_over_tensor_parallel_ranks_is_refused():
    for errors in run_on_ranks(_fsdp_over_tensor_parallel, 2, timeout=600):
        for tool, text in errors.items():
            assert f"{tool.split()[0]} spans ranks [0, 1]" in text, (tool, text)
            assert "mesh['dp']" in text or "mesh.get_group('dp')" in text, text
            assert all(words in text for words in ALTERNATIVE[1:]), text


def _ddp_over_data_parallel(steps: int = 3):
    """2 x 2 mesh: the model is tensor-parallel over "tp" and DDP averages over "dp", with
    sequence parallelism (the default), whose norm weights get partial gradients; each dp rank
    trains on its half of the batch, the reference on all of it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model, reference = build("llama", seed=0, **EVEN), build("llama", seed=0, **EVEN)
    try:
        autoshard.parallelize(model, mesh=mesh["tp"])
        ddp = DistributedDataParallel(model, process_group=mesh.get_group("dp"))
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.1)
        worst_grad = 0.0
        for step in range(steps):
            ids = _batch(step, rows=4)
            half = ids.chunk(2)[dp_rank]
            opt.zero_grad()
            ref_opt.zero_grad()
            ddp(input_ids=half, labels=half).loss.backward()
            reference(input_ids=ids, labels=ids).loss.backward()
            grads = gathered_grads(model)
            for name, p in reference.named_parameters():
                worst_grad = max(worst_grad, float((grads[name] - p.grad).abs().max()))
            opt.step()
            ref_opt.step()
        got, want = autoshard.full_state_dict(model), reference.state_dict()
        worst_weight = max(float((got[k] - want[k]).abs().max()) for k in want)
        ids = _batch(steps, rows=2)
        logits = (model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max()
        partial = autoshard.core.parallel_state.state_of(model).partial_gradients
        return dict(grad=worst_grad, weight=worst_weight, logits=float(logits),
                    partial=len(partial.buckets) if partial else 0)
    finally:
        set_default_group(None)


def test_ddp_over_data_parallel_is_exact():
    for r in run_on_ranks(_ddp_over_data_parallel, 4, timeout=900):
        assert r["partial"] > 0, "sequence parallelism should give the norm weights partial gradients"
        assert r["grad"] < 1e-5, r
        assert r["weight"] < 1e-4, r
        assert r["logits"] < 1e-4, r


def _ddp_over_data_parallel_inexact():
    """DDP over "dp" where it cannot be exact: around a model that parallelize already averages
    over "dp", and around a module holding a model whose norm weights get partial gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_group("dp")
    try:
        averaged = build("llama", seed=0, **EVEN)
        autoshard.parallelize(averaged, mesh=mesh)
        twice = error_text(lambda: DistributedDataParallel(averaged, process_group=dp))
        held = build("llama", seed=0, **EVEN)
        autoshard.parallelize(held, mesh=mesh["tp"])
        wrapped = DistributedDataParallel(_Holder(held), process_group=dp)
        around = error_text(lambda: wrapped(input_ids=_batch(), labels=_batch()))
        return twice, around
    finally:
        set_default_group(None)


def test_ddp_over_data_parallel_refused_where_inexact():
    for twice, around in run_on_ranks(_ddp_over_data_parallel_inexact, 4, timeout=900):
        assert "DistributedDataParallel over ranks" in twice and "already averages" in twice, twice
        assert "Drop the DDP wrapper" in twice and "parallelize(model, mesh=mesh['tp'])" in twice, twice
        assert "receive partial gradients" in around and "Wrap the parallelized model itself" in around, around
        assert "sequence_parallel=False" in around, around


def _inputs(check_inputs: bool = True, checkpointing: bool = False):
    rank = dist.get_rank()
    model, reference = build("llama", seed=0, **EVEN), build("llama", seed=0, **EVEN)
    autoshard.parallelize(model, check_inputs=check_inputs)
    if checkpointing:
        for m in (model, reference):
            m.train()
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = _batch()
    loss, want = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
    loss.backward()
    want.backward()
    grads = gathered_grads(model)
    worst = max(float((grads[n] - p.grad).abs().max()) for n, p in reference.named_parameters())
    own = _batch(1 + rank)  # each rank a batch of its own
    result = dict(loss=abs(float(loss) - float(want)), grad=worst,
                  ids=error_text(lambda: model(input_ids=own, labels=ids)),
                  labels=error_text(lambda: model(input_ids=ids, labels=own)))
    if check_inputs:  # without the check, these would fail or hang in the model's collectives
        result["length"] = error_text(lambda: model(input_ids=_batch(seq=8 + rank)))
        result["only_one"] = error_text(lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids)) if rank
                                    else model(ids))
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_different_inputs_are_refused_same_inputs_exact(world_size):
    for r in run_on_ranks(_inputs, world_size, timeout=600):
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5, r
        for key, words in (("ids", "input 'input_ids' (shape [2, 8]) holds different values on rank 0 and rank 1"),
                           ("labels", "input 'labels' (shape [2, 8]) holds different values"),
                           ("length", "input 'input_ids' has shape [2, 9] and dtype torch.int64 on rank 1, "
                                      "shape [2, 8]"),
                           ("only_one", "is given on rank")):
            text = r[key]
            assert words in text, (key, text)
            assert "every tensor-parallel rank must get the same batch" in text, text
            assert "parallelize(model, mesh=mesh)" in text and "DistributedSampler" in text, text
            assert "check_inputs=False" in text, text


def test_input_check_off_and_with_activation_checkpointing():
    off, checkpointed = run_on_ranks(_inputs, 2, False, timeout=600), run_on_ranks(_inputs, 2, True, True, timeout=600)
    for r in off:  # no check: nothing raised, though the result mixes the ranks' batches
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5, r
        assert r["ids"] == r["labels"] == "no error", r
    for r in checkpointed:
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5, r
        assert "holds different values" in r["ids"], r


def test_check_inputs_must_be_a_bool():
    with pytest.raises(TypeError, match="parallelize: check_inputs must be a bool, got int"):
        autoshard.parallelize(build("llama", seed=0, **EVEN), check_inputs=1)


def _compiled(backend: str = "aot_eager"):
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, reference = build("llama", seed=0, **EVEN), build("llama", seed=0, **EVEN)
    autoshard.parallelize(model)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ids = _batch()
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    refused = error_text(lambda: compiled(input_ids=_batch(1 + dist.get_rank()), labels=ids))
    return dict(loss=abs(float(loss) - float(reference(input_ids=ids, labels=ids).loss)),
                breaks=sum(counters["graph_break"].values()), refused=refused)


def test_checks_run_under_torch_compile_without_graph_breaks():
    for r in run_on_ranks(_compiled, 2, timeout=900):
        assert r["breaks"] == 0, r
        assert r["loss"] < 1e-5, r
        assert "holds different values" in r["refused"], r


def _fsdp1_over_data_parallel():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build("llama", seed=0, **EVEN)
    try:
        autoshard.parallelize(model, mesh=mesh["tp"])
        stand_in = _fsdp1_stand_in(model)
        stand_in.process_group = mesh.get_group("dp")
        ids = _batch()
        return error_text(lambda: stand_in(input_ids=ids, labels=ids))
    finally:
        set_default_group(None)


def test_fsdp1_over_data_parallel_ranks_is_refused():
    """FSDP1's flat parameters hide the shards: refused over "dp" too, naming FSDP2 (fully_shard
    over mesh['dp'], exact: test_fsdp2), autoshard's own mesh path and DDP over dp."""
    for text in run_on_ranks(_fsdp1_over_data_parallel, 4, timeout=600):
        assert "FullyShardedDataParallel over ranks" in text and "is not supported" in text, text
        assert "fully_shard(module, mesh=mesh['dp'])" in text and "parallelize(model, mesh=mesh['tp'])" in text, text
        assert "parallelize(model, mesh=mesh)" in text and "mesh.get_group('dp')" in text, text
