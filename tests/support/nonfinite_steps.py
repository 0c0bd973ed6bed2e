"""Rank functions for the test of a gradient that is not finite on one tensor-parallel rank only."""

import torch
import torch.distributed as dist

import autoshard
from checks import error_text
from hf_models import build

EVEN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, intermediate_size=128)


def _batch(step: int):
    return torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(100 + step))


def nan_on_one_rank(optimizer: str, where: str, sequence_parallel: bool = False, steps: int = 3):
    """Trains `steps` steps; at step 1 rank 1's gradient of the final norm's weight gets a nan
    (`where`: "backward", from a hook during backward; "clip", after backward, followed by
    clip_grad_norm_). Returns what each step raised and the bits of the replicated parameters after step 1."""
    rank = dist.get_rank()
    model = build("llama", seed=0, **EVEN)
    autoshard.parallelize(model, sequence_parallel=sequence_parallel)
    opt = (autoshard.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw"
           else autoshard.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    weight = model.model.norm.weight

    def poison(grad):
        grad = grad.clone()
        grad[0] = float("nan")
        return grad

    outcomes = []
    for step in range(steps):
        ids = _batch(step)
        handle = weight.register_hook(poison) if (step == 1 and rank == 1 and where == "backward") else None
        model(input_ids=ids, labels=ids).loss.backward()
        if handle is not None:
            handle.remove()
        if step == 1 and rank == 1 and where == "clip":
            weight.grad[0] = float("nan")
        if where == "clip":
            autoshard.clip_grad_norm_(model.parameters(), 1.0)
        outcomes.append(error_text(opt.step, RuntimeError))
        opt.zero_grad()
        if step == 1:  # a nan stepped into a copy reaches every rank at the next forward
            replicated = autoshard.runtime.replica_check.replicated_parameters(model)
            bits = {name: p.detach().view(torch.int32).clone() for name, p in replicated}
    return outcomes, bits
