"""Training steps of parallelized models against the unsharded model with torch's own
optimizers and clipping: fused AdamW and SGD, global-norm clipping, and data x tensor parallel
meshes (2 x 2, and 3 x 1 with uneven pieces) against full-batch single-process training, with
the optimizer state of replicated parameters partitioned over the data-parallel replicas."""

import pytest
import torch

import autoshard
from autoshard.core.distributed import set_default_group
from autoshard.core.parallel_state import state_of
from hf_models import build
from multirank import run_on_ranks

MAX_NORM = 0.5  # small enough that clipping acts on these random models


def _batch(step: int, rows: int = 4, seq: int = 8):
    return torch.randint(0, 101, (rows, seq), generator=torch.Generator().manual_seed(100 + step))


def _optimizers(kind: str, model, reference):
    if kind == "adamw":
        return (autoshard.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1),
                torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.1))
    options = dict(lr=5e-2, momentum=0.9, nesterov=True, weight_decay=0.01)
    return autoshard.optim.SGD(model.parameters(), **options), torch.optim.SGD(reference.parameters(), **options)


def _compare(model, reference, live):
    """Parameters against the reference, except elements whose exact gradient is zero.

    GPT-2's key bias adds the same q.b to every score of a query, which softmax ignores: its
    gradient is rounding noise (~1e-9), and AdamW, which divides by the gradient's own size,
    turns noise into steps of about lr. Those elements (`live` is False) are left out."""
    got, want = autoshard.full_state_dict(model), reference.state_dict()
    worst, noise_driven = 0.0, {}
    for k in want:
        mask = live.get(k, torch.ones_like(want[k], dtype=torch.bool))
        if not bool(mask.all()):
            noise_driven[k.rsplit(".", 3)[-2] + "." + k.rsplit(".", 1)[-1]] = int((~mask).sum())
        torch.testing.assert_close(got[k][mask], want[k][mask], rtol=1e-4, atol=1e-4, msg=lambda m: f"{k}: {m}")
        worst = max(worst, float((got[k] - want[k])[mask].abs().max()) if mask.any() else 0.0)
    return worst, noise_driven


def _track_live(reference, largest):
    """`largest` keeps each element's largest gradient so far; turned into the `live` mask by
    _live: elements whose gradient was never exactly zero yet never above 1e-6 are noise."""
    for name, p in reference.named_parameters():
        if p.grad is not None:
            largest[name] = torch.maximum(largest.get(name, torch.zeros_like(p)), p.grad.abs())


def _live(largest):
    return {name: (g == 0) | (g > 1e-6) for name, g in largest.items()}


def _train(model_kind: str, optimizer_kind: str, steps: int = 20):
    model, reference = build(model_kind, seed=0), build(model_kind, seed=0)
    autoshard.parallelize(model)
    opt, ref_opt = _optimizers(optimizer_kind, model, reference)
    norms, live = [], {}
    for step in range(steps):
        ids = _batch(step)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
        _track_live(reference, live)
        norm = autoshard.clip_grad_norm_(model.parameters(), MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        norms.append((float(norm), float(ref_norm)))
        opt.step()
        ref_opt.step()
    worst, noise_driven = _compare(model, reference, _live(live))
    return norms, worst, noise_driven


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("optimizer_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("model_kind", ["gpt2", "llama"])
def test_training_matches_unsharded(model_kind, optimizer_kind, world_size):
    norms, worst, noise_driven = run_on_ranks(_train, world_size, model_kind, optimizer_kind, timeout=600)[0]
    assert worst < 1e-4
    # Only GPT-2's key bias (a third of c_attn.bias) may be left out.
    assert set(noise_driven) <= {"c_attn.bias"}, noise_driven
    assert all(count <= 60 for count in noise_driven.values()), noise_driven
    assert any(ref > MAX_NORM for _, ref in norms), "clipping never acted"
    for got, ref in norms:
        assert abs(got - ref) <= 1e-5 * ref, (got, ref)


class PhaseCounters:
    """A CommCounter per phase of the training step, read over the data-parallel group."""

    def __init__(self, dp_group):
        self.dp_group = dp_group
        self.counters = {}

    def __call__(self, phase):
        return self.counters.setdefault(phase, autoshard.CommCounter())

    def totals(self):
        """(phase, kind) -> [calls, bytes] of the collectives over dp."""
        out = {}
        for phase, counter in self.counters.items():
            sizes = counter.bytes_of(self.dp_group)
            for kind, calls in counter.counts_of(self.dp_group).items():
                out[(phase, kind)] = [calls, sizes[kind]]
        return out


def _partition_report(model, opt, dp_size, dp_rank):
    """What the optimizer state and the data-parallel traffic should be: the elements of
    sharded and partitioned parameters, and whether every partitioned parameter's state
    holds exactly this rank's piece."""
    shards = state_of(model).shards()
    sharded_ids = {id(p) for p in model.parameters() if id(p) in shards and shards[id(p)][0].world_size > 1}
    sharded = sum(p.numel() for p in model.parameters() if id(p) in sharded_ids)
    # Replicated parameters with partial gradients (norm weights under sequence parallelism)
    # are summed over tp and averaged over dp by their own reducer, their state kept whole.
    reducer = state_of(model).partial_gradients
    summed = {id(p) for bucket in (reducer.buckets if reducer else ()) for p in bucket.params}
    padded_pieces, mismatched, partitioned = 0, [], 0
    for name, p in model.named_parameters():
        if id(p) in sharded_ids or id(p) in summed:
            shapes = {k: tuple(v.shape) for k, v in opt.state[p].items() if k != "step"}
            if any(shape != tuple(p.shape) for shape in shapes.values()):
                mismatched.append((name, "sharded", shapes))
            continue
        partitioned += 1
        share = autoshard.split_sizes(p.numel(), dp_size)
        padded_pieces += share[0]
        sizes = {k: v.numel() for k, v in opt.state[p].items() if k != "step"}
        if not sizes or any(n != share[dp_rank] for n in sizes.values()):
            mismatched.append((name, share[dp_rank], sizes))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return dict(sharded=sharded, padded_pieces=padded_pieces, partitioned=partitioned, mismatched=mismatched,
                trainable=trainable)


def _train_on_mesh(model_kind, optimizer_kind, shape, partition=True, micro_batches=1, steps=20,
                   sequence_parallel=True):
    """Each data-parallel replica trains on its part of the batch (in `micro_batches`
    backward passes that accumulate); the reference trains on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    dp_size = shape[0]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model, reference = build(model_kind, seed=0), build(model_kind, seed=0)
    try:
        autoshard.parallelize(model, mesh=mesh, partition_optimizer_state=partition,
                              sequence_parallel=sequence_parallel)
        opt, ref_opt = _optimizers(optimizer_kind, model, reference)
        norms, live = [], {}
        log = PhaseCounters(mesh.get_group("dp"))
        for step in range(steps):
            ids = _batch(step, rows=2 * dp_size)
            opt.zero_grad()
            with log("backward"):
                for micro in ids.chunk(dp_size)[dp_rank].chunk(micro_batches):
                    (model(input_ids=micro, labels=micro).loss / micro_batches).backward()
            with log("clip"):
                norm = autoshard.clip_grad_norm_(model.parameters(), MAX_NORM)
            with log("step"):
                opt.step()
            ref_opt.zero_grad()
            reference(input_ids=ids, labels=ids).loss.backward()
            _track_live(reference, live)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            ref_opt.step()
            norms.append((float(norm), float(ref_norm)))
        worst, noise_driven = _compare(model, reference, _live(live))
        return dict(norms=norms, worst=worst, noise_driven=noise_driven, traffic=log.totals(),
                    **_partition_report(model, opt, dp_size, dp_rank))
    finally:
        set_default_group(None)  # the pool's next job expects the world


def _check_mesh_training(results):
    for r in results:
        assert r["worst"] < 1e-4
        assert set(r["noise_driven"]) <= {"c_attn.bias"}, r["noise_driven"]
        assert any(ref > MAX_NORM for _, ref in r["norms"]), "clipping never acted"
        for got, ref in r["norms"]:
            assert abs(got - ref) <= 1e-5 * ref, (got, ref)


def _check_partitioned_traffic(r, dp_size, micro_batches=1, steps=20):
    """Per step and backward pass: replicated parameters' gradients go over dp as one
    reduce-scatter of their pieces (each rank's padded to rank 0's), never in an all-reduce;
    after each step one all-gather brings the pieces back; clipping adds one scalar
    all-reduce. Bytes are what this rank puts on the wire (fp32: 4 per element)."""
    traffic, passes = r["traffic"], steps * micro_batches
    assert r["partitioned"] > 0 and r["mismatched"] == [], r["mismatched"]
    assert traffic[("backward", "reduce_scatter")] == [passes, passes * dp_size * r["padded_pieces"] * 4]
    if r["sharded"]:
        calls, size = traffic[("backward", "all_reduce")]
        assert size == passes * r["sharded"] * 4, (size, r["sharded"])
    else:
        assert ("backward", "all_reduce") not in traffic
    assert traffic[("step", "all_gather")] == [steps, steps * r["padded_pieces"] * 4]
    assert traffic[("clip", "all_reduce")] == [steps, steps * 4]
    assert set(traffic) <= {("backward", "reduce_scatter"), ("backward", "all_reduce"), ("step", "all_gather"),
                            ("clip", "all_reduce")}, traffic


@pytest.mark.parametrize("optimizer_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("model_kind", ["gpt2", "llama"])
def test_data_by_tensor_parallel_mesh_matches_full_batch(model_kind, optimizer_kind):
    """2 x 2 dp x tp mesh, replicated parameters' state partitioned over dp. Sequence
    parallelism off: with it, Llama's only replicated parameters (norm weights) have partial
    gradients, summed by their own reducer and left out of the partitions this test counts."""
    results = run_on_ranks(_train_on_mesh, 4, model_kind, optimizer_kind, (2, 2), timeout=900,
                           sequence_parallel=False)
    _check_mesh_training(results)
    for r in results:
        _check_partitioned_traffic(r, dp_size=2)


def test_mesh_with_sequence_parallelism_matches_full_batch():
    """2 x 2 dp x tp mesh with sequence parallelism (the default): the norm weights' partial
    gradients are summed over tp and averaged over dp, and training equals the full batch's."""
    results = run_on_ranks(_train_on_mesh, 4, "llama", "adamw", (2, 2), timeout=900)
    _check_mesh_training(results)


def test_mesh_without_partitioning_all_reduces_everything():
    results = run_on_ranks(_train_on_mesh, 4, "gpt2", "adamw", (2, 2), False, steps=10, timeout=900)
    _check_mesh_training(results)
    for r in results:
        assert set(r["traffic"]) == {("backward", "all_reduce")}, r["traffic"]
        assert r["traffic"][("backward", "all_reduce")][1] == 10 * r["trainable"] * 4


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_three_replicas_partition_unevenly(micro_batches):
    """dp = 3, tp = 1: every parameter's state is split in three uneven pieces; with two
    micro-batches, gradients accumulate over two backward passes before the step."""
    results = run_on_ranks(_train_on_mesh, 3, "llama", "adamw", (3, 1), True, micro_batches, timeout=900)
    _check_mesh_training(results)
    for r in results:
        _check_partitioned_traffic(r, dp_size=3, micro_batches=micro_batches)


def _state_dict_round_trip(steps: int = 3):
    """Partitioned AdamW state after a few steps on a 2 x 2 mesh: against torch's state for the
    unsharded model, through state_dict / load_state_dict, and cut from torch's whole state."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoshard.runtime.optimizer_partition import piece_of

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    model, reference = build("gpt2", seed=0), build("gpt2", seed=0)
    try:
        autoshard.parallelize(model, mesh=mesh)
        opt, ref_opt = _optimizers("adamw", model, reference)
        for step in range(steps):
            ids = _batch(step)
            half = ids.chunk(2)[dp_rank]
            for m, o, x in ((model, opt, half), (reference, ref_opt, ids)):
                o.zero_grad()
                m(input_ids=x, labels=x).loss.backward()
                o.step()
        pairs = [(p, q) for p, q in zip(model.parameters(), reference.parameters()) if piece_of(p) is not None]
        reloaded = autoshard.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
        reloaded.load_state_dict(opt.state_dict())
        from_torch = autoshard.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
        from_torch.load_state_dict(ref_opt.state_dict())
        worst = 0.0
        for p, q in pairs:
            piece = piece_of(p)
            for key in ("exp_avg", "exp_avg_sq"):
                ours, whole = opt.state[p][key], ref_opt.state[q][key]
                assert ours.shape == (piece.numel,) and whole.shape == q.shape
                worst = max(worst, float((ours - piece.of(whole)).abs().max()) if ours.numel() else 0.0)
                assert torch.equal(reloaded.state[p][key], ours)
                assert torch.equal(from_torch.state[p][key], piece.of(whole))
            assert float(opt.state[p]["step"]) == float(from_torch.state[p]["step"]) == steps
        return len(pairs), worst
    finally:
        set_default_group(None)


def test_partitioned_state_dict_holds_pieces_of_torchs_state():
    for count, worst in run_on_ranks(_state_dict_round_trip, 4, timeout=600):
        assert count > 0
        assert worst < 1e-6


def test_clip_grad_norm_bad_input():
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="max_norm must be a number >= 0"):
        autoshard.clip_grad_norm_([p], -1.0)
    with pytest.raises(ValueError, match="norm_type must be a positive number"):
        autoshard.clip_grad_norm_([p], 1.0, norm_type=0)
    # Without any sharded parameter it is torch's clipping.
    q = torch.nn.Parameter(torch.ones(3))
    q.grad = torch.ones(3)
    assert torch.allclose(autoshard.clip_grad_norm_([p], 1.0), torch.nn.utils.clip_grad_norm_([q], 1.0))
    assert torch.allclose(p.grad, q.grad)
