"""FSDP2 (``fully_shard``) over the "dp" dimension of a 2 x 2 ("dp", "tp") mesh, after
``autoshard.parallelize(model, mesh=mesh["tp"])``: torch's 2-D recipe, with autoshard for the
tensor parallelism. Against the unsharded Hugging Face Llama trained on the whole batch (each
dp replica gets its half), with sequence parallelism on (the default: the norm weights' partial
gradients are summed over "tp") and off: the loss, every full gradient, the global norm that
``autoshard.clip_grad_norm_`` returns and clips with, and the weights and the trained model's
logits after several AdamW steps, with ``autoshard.optim.AdamW`` and with ``torch.optim.AdamW``;
``full_state_dict`` gives the unsharded tensors on every rank. Gradient accumulation under
``set_requires_gradient_sync(False)`` counts each pass's partial sums once.

Refused, with the alternative named: fully_shard around a model that ``parallelize(model,
mesh=mesh)`` already averages over "dp"; ``model.state_dict()`` and ``optimizer.state_dict()``,
whose FSDP pieces of tensor-parallel shards a tool reading by name (DCP) would take for whole
tensors; and
``autoshard.checkpoint``. fully_shard applied after a forward is found at the next one. fully_shard over the
tensor-parallel ranks is refused too (test_misuse).
"""

import pytest
import torch
import torch.distributed as dist

import autoshard
from autoshard.core.distributed import set_default_group
from autoshard.core.parallel_state import state_of
from autoshard.state.unsharded import gather_full
from hf_models import build
from multirank import run_on_ranks

# Even shards at tp=2: hidden 64, 4 heads over 2 KV heads (GQA), vocabulary 256.
EVEN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, intermediate_size=128)
# One KV head held by both tensor-parallel ranks: its gradient is summed over them, and clipping
# counts it once.
SHARED_KV = dict(EVEN, num_key_value_heads=1)
MAX_NORM = 0.5  # below the gradients' norm (about 1.4): clipping scales every step


def _batch(step: int, rows: int = 4, seq: int = 8):
    return torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(100 + step))


def _fully_sharded_model(sequence_parallel: bool, mesh_spelling: str = "tp", config=EVEN):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build("llama", seed=0, **config)
    if mesh_spelling == "keyword":  # autoshard applies fully_shard itself
        autoshard.parallelize(model, mesh=mesh, sequence_parallel=sequence_parallel, fully_shard=True)
        return model, mesh
    autoshard.parallelize(model, mesh=mesh["tp"] if mesh_spelling == "tp" else mesh,
                          sequence_parallel=sequence_parallel)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh


def _full_grads(model):
    """Every parameter's full gradient: FSDP's pieces gathered over "dp", then the shards over "tp"."""
    shards = state_of(model).shards()
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        if id(p) in shards:
            spec, group = shards[id(p)]
            grad = gather_full(grad, spec, group)
        grads[name] = grad
    return grads


def _worst(got: dict, want: dict) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def _train(sequence_parallel: bool, optimizer: str, config=EVEN, spelling: str = "tp", steps: int = 3):
    try:
        model, mesh = _fully_sharded_model(sequence_parallel, spelling, config)
        dp_rank, dp_group = mesh.get_local_rank("dp"), mesh.get_group("dp")
        reference = build("llama", seed=0, **config)
        make = autoshard.optim.AdamW if optimizer == "autoshard" else torch.optim.AdamW
        opt = make(model.parameters(), lr=2e-3, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.1)
        worst = dict(loss=0.0, grad=0.0, norm=0.0, weight=0.0, torch_norm=0.0)
        for step in range(steps):
            ids = _batch(step)
            half = ids.chunk(2)[dp_rank]
            opt.zero_grad()
            ref_opt.zero_grad()
            loss = model(input_ids=half, labels=half).loss
            loss.backward()
            ref_loss = reference(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=dp_group)
            worst["loss"] = max(worst["loss"], abs(float(mean) / 2 - float(ref_loss.detach())))
            worst["grad"] = max(worst["grad"], _worst(_full_grads(model), dict(
                (n, p.grad) for n, p in reference.named_parameters())))
            norm = autoshard.clip_grad_norm_(model.parameters(), MAX_NORM)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            worst["norm"] = max(worst["norm"], abs(float(norm) - float(ref_norm)))
            assert float(ref_norm) > 2 * MAX_NORM
            opt.step()
            ref_opt.step()
            worst["weight"] = max(worst["weight"], _worst(autoshard.full_state_dict(model), reference.state_dict()))
        ids = _batch(steps, rows=2)
        with torch.no_grad():
            worst["logits"] = float((model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max())
        # The max norm too, each rank given the same batch (FSDP averages the same gradients).
        opt.zero_grad()
        ref_opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        reference(input_ids=ids, labels=ids).loss.backward()
        ours = float(autoshard.clip_grad_norm_(model.parameters(), float("inf")))
        theirs = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), float("inf")))
        worst["inf_norm"] = abs(ours - theirs)
        return worst
    finally:
        set_default_group(None)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "no_sp"])
@pytest.mark.parametrize("optimizer", ["autoshard", "torch"])
def test_fully_shard_over_dp_trains_exactly(sequence_parallel, optimizer):
    for r in run_on_ranks(_train, 4, sequence_parallel, optimizer, timeout=900):
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["norm"] < 1e-5, r
        assert r["weight"] < 1e-5 and r["logits"] < 1e-4 and r["inf_norm"] < 1e-6, r


def test_shared_kv_head_trains_exactly():
    for r in run_on_ranks(_train, 4, True, "autoshard", SHARED_KV, timeout=900):
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["norm"] < 1e-5, r
        assert r["weight"] < 1e-5 and r["logits"] < 1e-4 and r["inf_norm"] < 1e-6, r


def test_mesh_path_with_fully_shard_keyword_trains_exactly():
    """parallelize(model, mesh=mesh, fully_shard=True) applies fully_shard over "dp" itself."""
    for r in run_on_ranks(_train, 4, True, "autoshard", EVEN, "keyword", timeout=900):
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5 and r["norm"] < 1e-5, r
        assert r["weight"] < 1e-5 and r["logits"] < 1e-4 and r["inf_norm"] < 1e-6, r


def _accumulated(checkpointing: bool):
    """Two backward passes without gradient sync, then one with: FSDP reduce-scatters the
    accumulated unsharded gradients once; each pass's partial sums over "tp" counted once.
    With Hugging Face's activation checkpointing, the blocks' recomputed forwards too."""
    try:
        model, mesh = _fully_sharded_model(sequence_parallel=True)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(use_reentrant=False))
            model.train()
        dp_rank = mesh.get_local_rank("dp")
        reference = build("llama", seed=0, **EVEN)
        for micro in range(3):
            model.set_requires_gradient_sync(micro == 2)
            ids = _batch(micro)
            half = ids.chunk(2)[dp_rank]
            model(input_ids=half, labels=half).loss.backward()
            reference(input_ids=ids, labels=ids).loss.backward()
        grads = _full_grads(model)
        return _worst(grads, {n: p.grad for n, p in reference.named_parameters()})
    finally:
        set_default_group(None)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation_checkpointing"])
def test_gradient_accumulation_without_sync_is_exact(checkpointing):
    for worst in run_on_ranks(_accumulated, 4, checkpointing, timeout=900):
        assert worst < 1e-5, worst


def _wrapped_after_a_forward():
    """fully_shard applied after the model already ran a forward is found at the next one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model, reference = build("llama", seed=0, **EVEN), build("llama", seed=0, **EVEN)
        autoshard.parallelize(model, mesh=mesh["tp"])
        ids = _batch(0)
        with torch.no_grad():
            model(input_ids=ids)
        for layer in model.model.layers:  # the blocks only: the root stays as it was
            fully_shard(layer, mesh=mesh["dp"])
        half = ids.chunk(2)[mesh.get_local_rank("dp")]
        model(input_ids=half, labels=half).loss.backward()
        reference(input_ids=ids, labels=ids).loss.backward()
        layer_grads = {n: g for n, g in _full_grads(model).items() if n.startswith("model.layers.")}
        return _worst(layer_grads, {n: p.grad for n, p in reference.named_parameters() if n in layer_grads})
    finally:
        set_default_group(None)


def test_fully_shard_after_a_forward_is_found():
    for worst in run_on_ranks(_wrapped_after_a_forward, 4, timeout=900):
        assert worst < 1e-5, worst


def _full_state_dict_and_refusals():
    try:
        model, _ = _fully_sharded_model(sequence_parallel=True)
        ids = _batch(0, rows=2)
        model(input_ids=ids, labels=ids).loss.backward()
        opt = autoshard.optim.AdamW(model.parameters(), lr=0.0)
        opt.step()
        full = autoshard.full_state_dict(model)
        want = build("llama", seed=0, **EVEN).state_dict()
        shapes_match = {k: list(v.shape) for k, v in full.items()} == {k: list(v.shape) for k, v in want.items()}
        plain = all(type(v) is torch.Tensor for v in full.values())
        try:
            model.state_dict()
            state_dict = "no error"
        except ValueError as error:
            state_dict = str(error)
        try:
            opt.state_dict()
            optimizer_state = "no error"
        except ValueError as error:
            optimizer_state = str(error)
        try:
            autoshard.checkpoint.save(f"/nonexistent-{dist.get_rank()}/checkpoint", model)
            checkpoint = "no error"
        except ValueError as error:
            checkpoint = str(error)
    finally:
        set_default_group(None)
    try:
        mesh_model, _ = _fully_sharded_model(sequence_parallel=True, mesh_spelling="mesh")
        try:
            mesh_model(input_ids=ids, labels=ids)
            mesh_path = "no error"
        except ValueError as error:
            mesh_path = str(error)
    finally:
        set_default_group(None)
    return dict(weights=_worst(full, want), shapes_match=shapes_match, plain=plain, state_dict=state_dict,
                optimizer_state=optimizer_state, checkpoint=checkpoint, mesh_path=mesh_path)


def test_full_state_dict_and_refusals():
    for r in run_on_ranks(_full_state_dict_and_refusals, 4, timeout=900):
        assert r["shapes_match"] and r["plain"] and r["weights"] == 0.0, r
        text = r["state_dict"]
        assert "fully_shard" in text and "autoshard.full_state_dict(model)" in text, text
        assert "parallelize(model, mesh=mesh)" in text, text
        text = r["optimizer_state"]
        assert text.startswith("optimizer.state_dict(): state 'exp_avg'") and "FSDP's piece" in text, text
        assert "parallelize(model, mesh=mesh)" in text, text
        text = r["checkpoint"]
        assert "autoshard.checkpoint" in text and "fully_shard" in text, text
        assert "autoshard.full_state_dict(model)" in text and "parallelize(model, mesh=mesh)" in text, text
        text = r["mesh_path"]
        assert "fully_shard over ranks" in text and "averaged twice" in text, text
        assert "parallelize(model, mesh=mesh['tp'])" in text and "mesh=mesh['dp']" in text, text


def test_fully_shard_keyword_bad_input_is_refused_before_anything_changes():
    model = build("llama", seed=0, **EVEN)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"fully_shard=True shards over the 'dp' dimension .* give mesh="):
        autoshard.parallelize(model, fully_shard=True)
    with pytest.raises(TypeError, match="parallelize: fully_shard must be a bool"):
        autoshard.parallelize(model, fully_shard="yes")
    assert state_of(model) is None
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
