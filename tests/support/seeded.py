"""Tensors derived from a seed, so that each rank can rebuild what the others hold."""

import torch


def seeded(shape, seed, dtype=torch.float32, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=generator).to(device)
    return torch.randn(shape, generator=generator, dtype=dtype).to(device)
