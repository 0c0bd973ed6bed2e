"""torch.optim on autoshard's mesh path (4 ranks, a 2 x 2 ("dp", "tp") mesh).

With partition_optimizer_state=True (the default), the parameters that tensor parallelism
replicates have their optimizer state partitioned over "dp": after backward each rank's
gradient holds the average of its own piece only. torch.optim.AdamW, which steps every
element, is refused at its first step, before any parameter changes, with the fix named;
autoshard's AdamW steps the same model. With partition_optimizer_state=False, torch's AdamW
trains exactly as the unsharded model does on the whole batch: gradients, weights after
each step and the trained model's logits. Sequence parallelism is off, so that the norm
weights are replicated parameters with whole gradients (the ones partitioned).
"""

import torch

import autoshard
from autoshard.runtime.optimizer_partition import piece_of
from gathered import gathered_grads
from hf_models import build
from multirank import run_on_ranks

EVEN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, intermediate_size=128)


def _batch(step: int, rows: int = 4, seq: int = 8):
    return torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(100 + step))


def _mesh_model(partition: bool):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build("llama", seed=0, **EVEN)
    autoshard.parallelize(model, mesh=mesh, sequence_parallel=False, partition_optimizer_state=partition)
    # The mesh's "tp" group is the model's own; parallelize sets no process-wide group.
    assert model.autoshard_state.group is mesh.get_group("tp")
    assert autoshard.core.distributed._default_group is None
    return model, mesh.get_local_rank("dp")


def _refused_with_partitioned_state():
    model, dp_rank = _mesh_model(partition=True)
    partitioned = sum(piece_of(p) is not None for p in model.parameters())
    half = _batch(0).chunk(2)[dp_rank]
    model(input_ids=half, labels=half).loss.backward()
    before = autoshard.full_state_dict(model)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    try:
        opt.step()
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    after = autoshard.full_state_dict(model)
    unchanged = all(torch.equal(before[k], after[k]) for k in before) and not opt.state
    ours = autoshard.optim.AdamW(model.parameters(), lr=2e-3)
    ours.step()  # autoshard's own optimizer steps the pieces
    stepped = any(not torch.equal(before[k], v) for k, v in autoshard.full_state_dict(model).items())
    return dict(partitioned=partitioned, refused=refused, unchanged=unchanged, stepped=stepped)


def test_torch_adamw_over_partitioned_state_is_refused():
    for r in run_on_ranks(_refused_with_partitioned_state, 4, timeout=900):
        assert r["partitioned"] > 0, r
        text = r["refused"]
        assert text.startswith("torch.optim.adamw.AdamW: param_groups[0]['params']["), text
        assert "model.norm.weight" in text or "layernorm.weight" in text, text
        assert "autoshard.optim.AdamW" in text and "partition_optimizer_state=False" in text, text
        assert "Nothing was stepped" in text
        assert r["unchanged"], "the refused step changed the model or kept state"
        assert r["stepped"], "autoshard.optim.AdamW did not step"


def _torch_adamw_without_partitioning(steps: int = 3):
    model, dp_rank = _mesh_model(partition=False)
    reference = build("llama", seed=0, **EVEN)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.1)
    worst = dict(grad=0.0, weight=0.0)
    for step in range(steps):
        ids = _batch(step)
        half = ids.chunk(2)[dp_rank]
        opt.zero_grad()
        ref_opt.zero_grad()
        model(input_ids=half, labels=half).loss.backward()
        reference(input_ids=ids, labels=ids).loss.backward()
        grads = gathered_grads(model)
        worst["grad"] = max([worst["grad"]] + [float((grads[n] - p.grad).abs().max())
                                               for n, p in reference.named_parameters()])
        opt.step()
        ref_opt.step()
        got, want = autoshard.full_state_dict(model), reference.state_dict()
        worst["weight"] = max([worst["weight"]] + [float((got[k] - want[k]).abs().max()) for k in want])
    ids = _batch(steps, rows=2)
    worst["logits"] = float((model(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max())
    return worst


def test_torch_adamw_without_partitioning_is_exact():
    for r in run_on_ranks(_torch_adamw_without_partitioning, 4, timeout=900):
        assert r["grad"] < 1e-5 and r["weight"] < 1e-4 and r["logits"] < 1e-4, r
