"""Training a parallelized language model beside its unsharded copy: the same batches, autoshard's
AdamW and clipping against torch.optim.AdamW and torch's clip_grad_norm_; and one step saved as
a checkpoint."""

import torch

import autoshard
from autoshard import checkpoint


def adamw_with_clipping(model, reference, steps: int, max_norm: float, vocab: int = 101):
    """`steps` AdamW steps with clipping at `max_norm` on `model` (parallelized here) and on
    `reference` (unsharded): [(autoshard's norm, torch's)] per step, and the largest difference
    between the full state dicts afterwards."""
    autoshard.parallelize(model)
    opt = autoshard.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.1)
    norms = []
    for step in range(steps):
        ids = torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(100 + step))
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
        norm = autoshard.clip_grad_norm_(model.parameters(), max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        norms.append((float(norm), float(ref_norm)))
        opt.step()
        ref_opt.step()
    got, want = autoshard.full_state_dict(model), reference.state_dict()
    return norms, max(float((got[k] - want[k]).abs().max()) for k in want)


def save_after_one_step(model, path: str):
    """Parallelizes `model`, takes one AdamW step (lr 2e-3) on a batch of token ids drawn from
    seed 3 and saves the model and optimizer at `path` with extra {"step": 1}; returns the
    optimizer."""
    autoshard.parallelize(model)
    opt = autoshard.optim.AdamW(model.parameters(), lr=2e-3)
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(3))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    checkpoint.save(path, model, opt, extra={"step": 1})
    return opt
