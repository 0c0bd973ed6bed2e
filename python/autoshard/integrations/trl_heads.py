"""TRL's fused LM head over vocabulary shards.

TRL's trainers (SFTTrainer, DPOTrainer, ...) give the model a forward that, called with
``fused_lm_head=True``, runs the backbone and then computes each token's log-probability (and
entropy, top-1 flag, ...) from ``get_output_embeddings().weight`` itself, in chunks, never
materialising the logits. On a parallelized model that weight is this rank's vocabulary shard,
which the shard guard refuses to multiply. Here the chunked function of that one forward is
replaced, on that model instance only, by ``VocabParallelLogProbs``: the same per-token fields
computed from the shards, with a few small all-reduces per call and no rank holding all logits.
TRL's own code (the shift, the mask, the loss, the metrics) runs unchanged around it.

``AutoshardTrainerMixin`` does this before each loss, so ``class SFT(AutoshardTrainerMixin,
SFTTrainer)`` (or ``autoshard.integrations.SFTTrainer``) is all a TRL user adds.
"""

import math
import types
from typing import Optional

import torch
from torch import nn

from ..conventions import huggingface as hf
from ..core import ops
from ..nn.linear import ColumnParallelLinear

_CHUNKED = "_ChunkedLogProbFunction"  # the name TRL's fused forward calls its chunked function by
_REBOUND = "_autoshard_vocab_parallel"


class VocabParallelLogProbs:
    """``ChunkedLogProbFunction.apply``'s signature and results for a column-parallel head: the
    logits' transform (scale, softcap, temperature) and statistics in float32 as TRL computes
    them, summed over the ranks (one all-reduce of the maxima, one of the sums, differentiable)."""

    def __init__(self, head: ColumnParallelLinear):
        self.head = head
        self.group_name = head._group_name
        ((self.vocab_start, _),) = head.shard_specs["weight"].local_ranges()
        self.vocab_size = head.out_features

    def apply(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
              temperature: float, chunk_size: int, final_logit_softcapping: Optional[float] = None,
              logit_scale: float = 1.0, outputs=("log_probs",)):
        if weight is not self.head.weight:
            raise RuntimeError("autoshard: TRL's fused LM head was given a weight other than the output head's "
                               f"{tuple(weight.shape)}; parallelize the model after TRL has set up its head")
        device = hidden.device
        compute_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) \
            else hidden.dtype
        # Through the head itself: its input copy carries the hidden states' gradient back as the plan
        # has it (summed over the ranks, or reduce-scattered where the tokens were gathered for it).
        gather, self.head.gather_output = self.head.gather_output, False
        try:
            z = self.head(hidden.to(compute_dtype)).float()
        finally:
            self.head.gather_output = gather
        z = z * logit_scale
        if final_logit_softcapping is not None:
            z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
        z = z * (1 / temperature)
        columns = torch.arange(self.vocab_start, self.vocab_start + z.shape[-1], device=device)
        with torch.no_grad():
            # An argmax returns the first maximum: the target is top-1 only if no earlier token ties it.
            maxima = torch.stack([z.amax(-1), z.masked_fill(columns >= targets.unsqueeze(-1), -math.inf).amax(-1)])
            ops.all_reduce_(maxima, "max", self.group_name)
        top, before_target = maxima[0], maxima[1]
        e = torch.exp(z - top.unsqueeze(-1))
        owned = (targets >= self.vocab_start) & (targets < self.vocab_start + z.shape[-1])
        target_z = z.gather(-1, (targets - self.vocab_start).clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
        sums = ops.reduce_from_parallel(torch.stack([e.sum(-1), (e * z).sum(-1), (e * e).sum(-1), z.sum(-1),
                                                     torch.where(owned, target_z, torch.zeros_like(target_z))]),
                                        self.group_name)
        sum_exp, z_sum_exp, sq_sum_exp, z_sum, target_logit = sums.unbind(0)
        log_z = top + torch.log(sum_exp)
        log_probs = target_logit - log_z
        entropy = log_z - z_sum_exp / sum_exp if "entropy" in outputs else None
        log_sum_sq_probs = (torch.log(sq_sum_exp) - 2 * torch.log(sum_exp)).detach() \
            if "log_sum_sq_probs" in outputs else None
        mean_logits = (z_sum / self.vocab_size).detach() if "mean_logits" in outputs else None
        is_top1 = ((target_logit >= top) & (target_logit > before_target)) if "is_top1" in outputs else None
        return log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1


def _sharded_head(model: nn.Module) -> Optional[ColumnParallelLinear]:
    head = hf.output_embeddings(model)
    # One contiguous run of the vocabulary per rank, as a loss over the vocabulary needs.
    if isinstance(head, ColumnParallelLinear) and len(head.shard_specs["weight"].local_ranges()) == 1:
        return head
    return None


def fuse_over_shards(model: nn.Module) -> bool:
    """If TRL gave `model` its fused-head forward and the head is split over the vocabulary,
    makes that forward compute over the shards. Returns whether the model's forward is now so."""
    forward = model.__dict__.get("forward")
    func = getattr(forward, "__func__", None)
    if func is None or getattr(func, _REBOUND, False):
        return func is not None
    head = _sharded_head(model)
    if func.__code__.co_name != "_fused_forward" or head is None:
        return False
    if _CHUNKED not in func.__globals__ or not {_CHUNKED, "apply"} <= set(func.__code__.co_names):
        raise RuntimeError(
            "autoshard: this TRL version's fused LM head does not call _ChunkedLogProbFunction, which autoshard "
            "computes over the vocabulary shards; use the TRL version requirements-dev.txt names, or parallelize "
            "the model with loss_parallel=False and a plan that keeps the output head whole")
    namespace = dict(func.__globals__)
    namespace[_CHUNKED] = VocabParallelLogProbs(head)
    rebound = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)
    rebound.__kwdefaults__ = func.__kwdefaults__
    rebound.__dict__.update(func.__dict__)  # functools.wraps' __wrapped__: generate() reads the signature
    setattr(rebound, _REBOUND, True)
    model.forward = types.MethodType(rebound, model)
    return True

