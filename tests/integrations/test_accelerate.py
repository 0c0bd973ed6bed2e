"""accelerate's Accelerator with a parallelized model (the tiny Llama of hf_models: vocabulary 101, so
shards of 51 and 50 rows at 2 ranks): exact against the unsharded model, or refused in
accelerator.prepare with an error naming accelerate and what to use instead, before any parameter of
the model changed.

Ranks are gloo processes given torchrun's environment. accelerate 1.15 takes up its FSDP plugin, and
accepts a ParallelismConfig, only on accelerator devices: on CPU ranks it wraps the model in DDP
whatever the plugin says, and refuses a ParallelismConfig itself. ``_as_on_accelerators`` makes on
the CPU ranks the choice its state makes on GPUs (FSDP where given the plugin, else a multi-device
type), so that the rest of accelerate runs its GPU code on them.

- FSDP2 plugin, as accelerate runs it on CPU: DDP over every process, refused in its constructor.
- FSDP2 plugin over 2 ranks, tensor-parallel over both: accelerate applies fully_shard over every
  process, the shards' own ranks. It used to prepare the model and abort the process at the first
  forward (gloo: "Received data size doesn't match expected size"); now fully_shard refuses at its
  first look at a shard (shard_distribution).
- ParallelismConfig(tp_size=2): accelerate refuses a model without DTensor parameters itself.
- A shard labelled ``Replicate()`` over its own tensor-parallel ranks by ``DTensor.from_local`` (what
  accelerate's tensor-parallel preparation does to every parameter that is not a DTensor), or handed
  to ``distribute_tensor``, is refused; a replicated parameter, and ``autoshard.local`` of a shard
  described as such, are not.
- 4 ranks, ParallelismConfig(dp_shard_size=2, tp_size=2) with the FSDP2 plugin and
  ``parallelize(model, mesh=accelerator.torch_device_mesh["tp"])``: exact, losses, the norms
  ``accelerator.clip_grad_norm_`` clips by and the weights after three AdamW steps against the
  unsharded model on the whole batch. Refused: the model parallelized over all 4 ranks (FSDP2 over
  dp_shard would then split shards again; it used to abort the process too), and accelerate's
  labelling of shards ``Replicate()`` over "tp" once some parameter is a DTensor.
"""

import contextlib
import os

import torch
import torch.distributed as dist

import autoshard
from autoshard.core.distributed import set_default_group
from autoshard.runtime.shard_guard import ShardParameter
from checks import error_text
from hf_models import build
from multirank import run_on_ranks

MAX_NORM = 0.5  # below the gradients' norm (about 3): clipping scales every step


@contextlib.contextmanager
def _accelerate_env(as_on_accelerators: bool = False):
    """torchrun's environment for this rank, accelerate's process-wide state started afresh and
    cleared after (the rank processes are reused), and every variable accelerate sets restored.
    With `as_on_accelerators`, the distributed type accelerate's state picks on GPUs."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    saved = dict(os.environ)
    rank, world = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    AcceleratorState._reset_state(reset_partial_state=True)
    init = AcceleratorState.__init__

    def init_as_on_accelerators(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if self.distributed_type == DistributedType.MULTI_CPU:
            # As accelerate's state does for its multi-device types: FSDP where a plugin is given.
            if fsdp_plugin is not None:
                self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
            else:
                self.distributed_type = DistributedType.MULTI_GPU
            PartialState._shared_state["distributed_type"] = self.distributed_type

    if as_on_accelerators:
        AcceleratorState.__init__ = init_as_on_accelerators
    try:
        yield
    finally:
        AcceleratorState.__init__ = init
        AcceleratorState._reset_state(reset_partial_state=True)
        set_default_group(None)
        os.environ.clear()
        os.environ.update(saved)


def _accelerator(fsdp: bool, **parallelism):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import ParallelismConfig

    return Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2) if fsdp else None,
                       parallelism_config=ParallelismConfig(**parallelism) if parallelism else None)


def _batch(step: int, rows: int = 4, seq: int = 8):
    return torch.randint(0, 101, (rows, seq), generator=torch.Generator().manual_seed(100 + step))


def _snapshot(model):
    return {name: (p, autoshard.local(p).detach().clone()) for name, p in model.named_parameters()}


def _unchanged(model, snapshot) -> bool:
    """The model holds the same parameter objects, of the same classes, with the same values."""
    now = dict(model.named_parameters())
    return now.keys() == snapshot.keys() and all(
        now[name] is p and type(p) in (ShardParameter, torch.nn.Parameter) and torch.equal(autoshard.local(p), value)
        for name, (p, value) in snapshot.items())


def _refused_prepare(as_on_accelerators: bool, fsdp: bool, error=ValueError, **parallelism):
    """accelerator.prepare(model, optimizer) of the tiny Llama parallelized over both ranks: the
    error, whether the model is unchanged, and its loss after against the unsharded model's."""
    with _accelerate_env(as_on_accelerators):
        accelerator = _accelerator(fsdp, **parallelism)
        model, reference = build("llama", seed=0), build("llama", seed=0)
        autoshard.parallelize(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = _snapshot(model)
        text = error_text(lambda: accelerator.prepare(model, optimizer), error)
        ids = _batch(0, rows=2)
        with torch.no_grad():
            loss, want = model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss
        loss_gap = abs(float(loss) - float(want))
        return dict(text=text, unchanged=_unchanged(model, before), loss_gap=loss_gap)


def test_fsdp_plugin_on_cpu_is_ddp_and_refused():
    for r in run_on_ranks(_refused_prepare, 2, False, True, timeout=600):
        text = r["text"]
        assert "DistributedDataParallel spans ranks [0, 1]" in text, text
        assert "refused before its first broadcast" in text, text
        assert "accelerate" in text and "autoshard.integrations.Trainer" in text, text
        assert r["unchanged"] and r["loss_gap"] < 1e-5, r


def test_fsdp2_plugin_over_the_tensor_parallel_ranks_is_refused_before_any_change():
    for r in run_on_ranks(_refused_prepare, 2, True, True, timeout=600):
        text = r["text"]
        assert "fully_shard spans ranks [0, 1]" in text and "before FSDP replaced any parameter" in text, text
        assert "accelerate applied fully_shard here" in text, text
        assert "autoshard.parallelize(model, mesh=accelerator.torch_device_mesh['tp'])" in text, text
        assert "parallelize(model, mesh=mesh, fully_shard=True)" in text, text
        assert "autoshard.integrations.Trainer" in text, text
        assert r["unchanged"] and r["loss_gap"] < 1e-5, r


def test_parallelism_config_tensor_parallel_alone_is_refused_by_accelerate():
    for r in run_on_ranks(_refused_prepare, 2, True, False, NotImplementedError, tp_size=2,
                          timeout=600):
        assert "Model should undergo tensor parallel before passing it to accelerate" in r["text"], r["text"]
        assert r["unchanged"] and r["loss_gap"] < 1e-5, r


def _labels():
    """DTensors made of the tiny Llama's parameters over the mesh of its tensor-parallel ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model, reference = build("llama", seed=0), build("llama", seed=0)
        autoshard.parallelize(model)
        embed, up = model.model.embed_tokens.weight, model.model.layers[0].mlp.up_proj.weight
        norm = model.model.norm.weight
        refused = {
            # As accelerate's _prepare_tp labels every parameter that is not a DTensor.
            "from_local Replicate": error_text(lambda: DTensor.from_local(embed, device_mesh=mesh,
                                                                          placements=[Replicate()]),
                                               autoshard.ShardReadError),
            "from_local Shard": error_text(lambda: DTensor.from_local(up, mesh, [Shard(0)]), autoshard.ShardReadError),
            "distribute_tensor": error_text(lambda: distribute_tensor(up, mesh, [Replicate()]),
                                            autoshard.ShardReadError),
        }
        replicated = DTensor.from_local(norm, mesh, [Replicate()]).full_tensor()
        # The piece described for what it is: the vocabulary's 51 and 50 rows, as torch.chunk splits it.
        whole = DTensor.from_local(autoshard.local(embed), mesh, [Shard(0)], shape=torch.Size((101, 48)),
                                   stride=(48, 1)).full_tensor()
        want = reference.state_dict()
        return dict(refused=refused, replicated=torch.equal(replicated, want["model.norm.weight"]),
                    whole=torch.equal(whole, want["model.embed_tokens.weight"]))
    finally:
        set_default_group(None)


def test_a_shard_labelled_over_its_own_ranks_is_refused():
    for r in run_on_ranks(_labels, 2, timeout=600):
        for what, text in r["refused"].items():
            assert "holds this rank's shard" in text, (what, text)
            assert "ranks of its tensor-parallel group [0, 1]" in text, (what, text)
            assert "autoshard.local(tensor)" in text, (what, text)
        assert "DTensor.from_local of model.embed_tokens.weight" in r["refused"]["from_local Replicate"]
        assert "placement Replicate() over mesh dimension 'tp'" in r["refused"]["from_local Replicate"]
        assert "distribute_tensor of model.layers.0.mlp.up_proj.weight" in r["refused"]["distribute_tensor"]
        assert r["replicated"] and r["whole"], r


def _over_dp_shard(steps: int = 3):
    """ParallelismConfig(dp_shard_size=2, tp_size=2) and the FSDP2 plugin, the model parallelized
    over accelerate's "tp" dimension; against the unsharded model on the whole batch, of which each
    dp_shard replica gets its half."""
    with _accelerate_env(as_on_accelerators=True):
        accelerator = _accelerator(fsdp=True, dp_shard_size=2, tp_size=2)
        mesh = accelerator.torch_device_mesh
        model, reference = build("llama", seed=0), build("llama", seed=0)
        autoshard.parallelize(model, mesh=mesh["tp"])
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
        ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        dp_rank, dp_group = mesh["dp_shard"].get_local_rank(), mesh["dp_shard"].get_group()
        worst = dict(loss=0.0, norm=0.0, weight=0.0, ref_norm=float("inf"))
        for step in range(steps):
            ids = _batch(step)
            half = ids.chunk(2)[dp_rank]
            optimizer.zero_grad()
            ref_optimizer.zero_grad()
            loss = model(input_ids=half, labels=half).loss
            accelerator.backward(loss)
            ref_loss = reference(input_ids=ids, labels=ids).loss
            ref_loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=dp_group)
            worst["loss"] = max(worst["loss"], abs(float(mean) / 2 - float(ref_loss)))
            norm = accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
            worst["norm"] = max(worst["norm"], abs(float(norm) - float(ref_norm)))
            worst["ref_norm"] = min(worst["ref_norm"], float(ref_norm))
            optimizer.step()
            ref_optimizer.step()
        full = autoshard.full_state_dict(model)
        worst["weight"] = max(float((full[k] - v).abs().max()) for k, v in reference.state_dict().items())
        return worst


def test_fsdp2_plugin_over_dp_shard_with_the_model_over_tp_is_exact():
    for r in run_on_ranks(_over_dp_shard, 4, timeout=900):
        assert r["loss"] < 1e-5 and r["norm"] < 1e-5, r
        assert r["ref_norm"] > 2 * MAX_NORM, r
        # AdamW divides by the root of the second moment, which magnifies float32 rounding where a
        # gradient is near zero: 1.4e-5 measured after three steps.
        assert r["weight"] < 5e-5, r


def _refused_over_four():
    """The FSDP2 plugin over dp_shard with the model parallelized over all 4 ranks; and, with it
    parallelized over "tp" and its layers fully_shard-ed over dp_shard by hand, accelerate's
    tensor-parallel preparation labelling the rest Replicate() over "tp"."""
    from torch.distributed.fsdp import fully_shard
    import transformers.integrations.tensor_parallel as tensor_parallel

    errors = {}
    with _accelerate_env(as_on_accelerators=True):
        accelerator = _accelerator(fsdp=True, dp_shard_size=2, tp_size=2)
        model = build("llama", seed=0)
        autoshard.parallelize(model)
        before = _snapshot(model)
        errors["world"] = error_text(lambda: accelerator.prepare(model, torch.optim.AdamW(model.parameters())))
        errors["world unchanged"] = _unchanged(model, before)

    class ReplicateParallel:
        """What accelerate 1.15 imports from transformers (which 5.x no longer has), to apply to
        each module after labelling its parameters: it must never be reached."""

        def prepare_module_tp(self, module, mesh):
            raise AssertionError(f"accelerate went on to change {type(module).__name__}")

    had = hasattr(tensor_parallel, "ReplicateParallel")
    saved = getattr(tensor_parallel, "ReplicateParallel", None)
    tensor_parallel.ReplicateParallel = ReplicateParallel
    try:
        with _accelerate_env(as_on_accelerators=True):
            accelerator = _accelerator(fsdp=True, dp_shard_size=2, tp_size=2)
            model = build("llama", seed=0)
            autoshard.parallelize(model, mesh=accelerator.torch_device_mesh["tp"])
            for layer in model.model.layers:
                fully_shard(layer, mesh=accelerator.torch_device_mesh["dp_shard_cp"])
            errors["replicate"] = error_text(lambda: accelerator.prepare(model, torch.optim.AdamW(model.parameters())),
                                             autoshard.ShardReadError)
            errors["embedding unchanged"] = type(model.model.embed_tokens.weight) is ShardParameter
    finally:
        if had:
            tensor_parallel.ReplicateParallel = saved
        else:
            del tensor_parallel.ReplicateParallel
    return errors


def test_fsdp2_plugin_over_shards_or_labelling_them_replicated_is_refused():
    for rank, r in enumerate(run_on_ranks(_refused_over_four, 4, timeout=900)):
        text = r["world"]
        dp_ranks = [rank % 2, rank % 2 + 2]
        assert f"fully_shard spans ranks {dp_ranks}" in text and "tensor-parallel group [0, 1, 2, 3]" in text, text
        assert "accelerate applied fully_shard here" in text, text
        assert "autoshard.parallelize(model, mesh=accelerator.torch_device_mesh['tp'])" in text, text
        assert r["world unchanged"], r
        text = r["replicate"]
        assert "DTensor.from_local of model.embed_tokens.weight" in text, text
        assert "placement Replicate() over mesh dimension 'tp'" in text, text
        assert "accelerate's ParallelismConfig(tp_size=...)" in text and "autoshard.integrations.Trainer" in text, text
        assert "parallelize(model, mesh=mesh, fully_shard=True)" in text, text
        assert r["embedding unchanged"], r
