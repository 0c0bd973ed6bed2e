"""A small model written with plain torch.nn for checkpoint tests: a vocabulary-parallel
embedding tied to the output head, a column/row Linear pair, a LayerNorm that stays
replicated, and a persistent buffer."""

import torch
from torch import nn

VOCAB = 37


class TiedToy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 20)
        self.up = nn.Linear(20, 30)
        self.down = nn.Linear(30, 20)
        self.norm = nn.LayerNorm(20)
        self.head = nn.Linear(20, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("temperature", torch.tensor(1.5))

    def forward(self, ids):
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return self.head(self.norm(h)) / self.temperature


def build_toy(seed: int) -> TiedToy:
    torch.manual_seed(seed)
    return TiedToy()


def toy_ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(500 + step))


def parallelize_toy(model: TiedToy, **kwargs) -> TiedToy:
    import autoshard
    import torch.distributed as dist

    world = kwargs.pop("world_size", None) or dist.get_world_size()
    mesh = kwargs.get("mesh")
    if mesh is not None:
        world = mesh.size(mesh.mesh_dim_names.index("tp"))
    plan = autoshard.plan(model, world_size=world, example_inputs=(toy_ids(0),))
    return autoshard.parallelize(model, plan, **kwargs)
