"""parallelize(mesh=) sets nothing process-wide: where no model is at hand, group=None is the
world, and while a model parallelized over a mesh's "tp" is alive it is refused there (the world
would span the data-parallel replicas) with the remedy named; the model's own group is used
where the model is given."""

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autoshard
from autoshard.core import comm, distributed
from multirank import run_on_ranks


def _group_none_around_a_mesh_model():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    before = comm.world_size()
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
    autoshard.parallelize(model, mesh=mesh, example_inputs=(torch.randn(2, 8),))
    installed = distributed._default_group
    with pytest.raises(ValueError, match=r"group=None means the world \(4 ranks\).*over 2 ranks.*"
                                         r"group=model.autoshard_state.group"):
        comm.world_size()
    own = comm.world_size(model.autoshard_state.group)
    world = comm.world_size(dist.group.WORLD)
    del model
    gc.collect()
    return before, installed, own, world, comm.world_size()


def test_group_none_is_the_world_or_refused_beside_a_mesh_model():
    for result in run_on_ranks(_group_none_around_a_mesh_model, 4):
        assert result == (4, None, 2, 4, 4), result
