"""Lightning's Trainer and Fabric with a model autoshard parallelizes: Lightning's
``ModelParallelStrategy``, whose checkpoints also find autoshard's model.

Trainer (the LightningModule's ``configure_model`` parallelizes its model)::

    from autoshard.integrations.lightning import AutoshardStrategy

    def configure_model(self):
        autoshard.parallelize(self.model)
    trainer = lightning.Trainer(strategy=AutoshardStrategy(), ...)
    trainer.save_checkpoint("ckpt")                  # or ModelCheckpoint
    trainer.fit(module, data, ckpt_path="ckpt")      # model, optimizers, loops, schedulers

Fabric (``setup_module`` parallelizes the model)::

    from autoshard.integrations.lightning import AutoshardFabricStrategy

    fabric = lightning.Fabric(strategy=AutoshardFabricStrategy(), ...)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": step})
    fabric.load("ckpt", state)

Lightning's ModelParallelStrategy trains such a model as it is, but finds the model to checkpoint
by its DTensor parameters, and autoshard's shards are plain local tensors: ``fabric.save`` and a
Trainer's ``fit(ckpt_path=)`` stop at "Could not find a distributed model". These strategies find
the model by autoshard's state instead, and save and load it and its optimizers through torch's
DCP helpers (``get_model_state_dict`` / ``get_optimizer_state_dict``), whose sharded entries give
each rank's chunks of the global tensors (state_views, optimizer_views). The checkpoint is
ModelParallelStrategy's own layout (a DCP directory and ``meta.pt``); it reloads at another world
size and into the unsharded model in one process (``dcp.load(..., no_dist=True)``).

Every rank is tensor-parallel (``data_parallel_size`` 1). Checkpoints are sharded only:
``save_distributed_checkpoint=False`` would gather whole tensors on rank 0 through DTensor, which
these shards are not; ``autoshard.full_state_dict`` gives the whole weights.
"""

from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies.strategy import _validate_keys_for_strict_loading
from lightning.fabric.utilities.load import _METADATA_FILENAME, _move_state_into
from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies import ModelParallelStrategy as TrainerModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.optim import Optimizer

from ..core.parallel_state import parameters_states
from ..parallelize import parallelize

__all__ = ["AutoshardFabricStrategy", "AutoshardStrategy"]


def _is_parallelized(obj: Any) -> bool:
    return isinstance(obj, nn.Module) and bool(parameters_states(obj.parameters()))


def _require_parallelized(module: nn.Module, who: str, how: str) -> None:
    if not _is_parallelized(module):
        raise ValueError(f"{who}: the model holds no module parallelized by autoshard; {how}. A model parallelized "
                         "with DTensor (torch's parallelize_module, fully_shard) trains with lightning's own "
                         "ModelParallelStrategy")


def _refuse_full_file(save_distributed_checkpoint: bool, who: str) -> None:
    if not save_distributed_checkpoint:
        raise ValueError(f"{who}(save_distributed_checkpoint=False): a checkpoint of whole tensors on rank 0 is "
                         "gathered through DTensor, which autoshard's shards are not. Keep the sharded checkpoint "
                         "(the default: it loads into the unsharded model with torch.distributed.checkpoint.load"
                         "(..., no_dist=True)), or take the whole weights with autoshard.full_state_dict(model) "
                         "on every rank")


def _the_model(state: Dict[str, Any], who: str) -> Tuple[str, nn.Module]:
    found = [(key, obj) for key, obj in state.items() if _is_parallelized(obj)]
    if len(found) != 1:
        what = "no model parallelized by autoshard" if not found else f"{len(found)} parallelized models"
        raise ValueError(f"{who}: the state holds {what}; give the one model set up by the strategy, as in "
                         "state={'model': model, 'optimizer': optimizer, ...} (save further models to paths of "
                         "their own)")
    return found[0]


def _save(path: Path, state: Dict[str, Any], rank: int, who: str) -> None:
    _, module = _the_model(state, who)
    options = StateDictOptions(cpu_offload=True)
    sharded, metadata = {}, {}
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            sharded[key] = get_model_state_dict(obj, options=options)
        elif isinstance(obj, Optimizer):
            sharded[key] = get_optimizer_state_dict(module, obj, options=options)
        else:
            metadata[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
    if path.is_file():
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(sharded, checkpoint_id=path)
    if rank == 0:
        torch.save(metadata, path / _METADATA_FILENAME)


def _load(path: Path, state: Dict[str, Any], strict: bool, weights_only: Optional[bool], who: str) -> Dict[str, Any]:
    if not (path / _METADATA_FILENAME).is_file():
        raise ValueError(f"{who}: {str(path)!r} is no sharded checkpoint (a directory holding {_METADATA_FILENAME}), "
                         "the kind this strategy saves. A file of whole weights loads with "
                         "model.load_state_dict(its state dict) on every rank, each rank keeping its part")
    key, module = _the_model(state, who)
    # The live state dicts are the load targets: their sharded entries ask DCP for this rank's
    # chunks only, whatever world size saved them.
    loaded = {key: get_model_state_dict(module)}
    dcp.load(loaded, checkpoint_id=path)
    module.load_state_dict(loaded[key], strict=strict)
    optimizers = {k: obj for k, obj in state.items() if isinstance(obj, Optimizer)}
    for name, optimizer in optimizers.items():
        loaded = {name: get_optimizer_state_dict(module, optimizer)}
        dcp.load(loaded, checkpoint_id=path)
        set_optimizer_state_dict(module, optimizer, optim_state_dict=loaded[name])
    metadata = torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
    requested = state.keys() - {key} - optimizers.keys()
    _validate_keys_for_strict_loading(requested, metadata.keys(), strict=strict)
    _move_state_into(source=metadata, destination=state, keys=set(requested))
    return metadata


class AutoshardStrategy(TrainerModelParallelStrategy):
    """Lightning Trainer's ModelParallelStrategy for a LightningModule whose ``configure_model``
    calls ``autoshard.parallelize`` (once: it is called again at each ``fit``/``validate``/...);
    ``trainer.save_checkpoint`` and ``fit(ckpt_path=)`` save and restore the model and its
    optimizers' state (torch.optim or autoshard.optim)."""

    def __init__(self, data_parallel_size="auto", tensor_parallel_size="auto", save_distributed_checkpoint: bool = True,
                 **kwargs) -> None:
        _refuse_full_file(save_distributed_checkpoint, type(self).__name__)
        super().__init__(data_parallel_size, tensor_parallel_size, save_distributed_checkpoint, **kwargs)

    def setup(self, trainer) -> None:
        # configure_model has run: a model it left whole would train unsynchronised on every rank.
        _require_parallelized(self.model, type(self).__name__,
                              "call autoshard.parallelize(self.model) in the LightningModule's configure_model")
        super().setup(trainer)

    def load_checkpoint(self, checkpoint_path, weights_only: Optional[bool] = None) -> Dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        # The keys ModelParallelStrategy.save_checkpoint writes.
        state = {"state_dict": self.model, **{f"optimizer_{i}": opt for i, opt in enumerate(self.optimizers)}}
        return _load(path, state, self.lightning_module.strict_loading, weights_only,
                     f"{type(self).__name__}.load_checkpoint")


def _parallelize_every_rank(module: nn.Module, mesh) -> nn.Module:
    if mesh["data_parallel"].size() > 1:
        raise ValueError(f"AutoshardFabricStrategy: data_parallel_size={mesh['data_parallel'].size()} needs a "
                         "parallelize_fn of your own (autoshard.parallelize(model, mesh=...) with a ('dp', 'tp') "
                         "DeviceMesh); by default every rank is tensor-parallel (data_parallel_size=1)")
    return parallelize(module, group=mesh["tensor_parallel"].get_group())


class AutoshardFabricStrategy(FabricModelParallelStrategy):
    """Fabric's ModelParallelStrategy whose ``setup_module`` parallelizes the model with
    autoshard (over every rank, or with ``parallelize_fn(model, device_mesh)`` when given), and
    whose ``fabric.save`` / ``fabric.load`` save and restore it and its optimizers' state."""

    def __init__(self, parallelize_fn: Optional[Callable[[nn.Module, Any], nn.Module]] = None,
                 data_parallel_size="auto", tensor_parallel_size="auto", save_distributed_checkpoint: bool = True,
                 **kwargs) -> None:
        _refuse_full_file(save_distributed_checkpoint, type(self).__name__)
        super().__init__(parallelize_fn or _parallelize_every_rank, data_parallel_size, tensor_parallel_size,
                         save_distributed_checkpoint, **kwargs)

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        _require_parallelized(module, type(self).__name__, "its parallelize_fn must call autoshard.parallelize")
        return module

    def save_checkpoint(self, path, state, storage_options: Optional[Any] = None, filter=None) -> None:
        who = f"{type(self).__name__}.save_checkpoint"
        if storage_options is not None or filter is not None:
            raise TypeError(f"{who}: storage_options= and filter= are not supported (the checkpoint is sharded); "
                            "save the whole state, or a filtered autoshard.full_state_dict(model) yourself")
        _save(Path(self.broadcast(path)), state, self.global_rank, who)

    def load_checkpoint(self, path, state=None, strict: bool = True, weights_only: Optional[bool] = None):
        if not isinstance(state, dict) or not state:
            # The model alone from a file of whole weights, or the checks of Lightning's own.
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        return _load(Path(self.broadcast(path)), state, strict, weights_only, f"{type(self).__name__}.load_checkpoint")
