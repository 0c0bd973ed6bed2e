"""``transformers.Trainer`` for a parallelized model under torchrun: the one-process script, with
autoshard's Trainer in place of transformers'::

    # torchrun --nproc-per-node 2 train.py
    from autoshard.integrations import Trainer        # instead of: from transformers import Trainer
    autoshard.parallelize(model)                       # every rank tensor-parallel; or, for data
                                                       # parallelism too, parallelize(model, mesh=mesh)
                                                       # with a ("dp", "tp") DeviceMesh
    trainer = Trainer(model=model, args=args, train_dataset=..., eval_dataset=...)
    trainer.train()                                    # on every rank, as are evaluate() and
    trainer.save_model("out/")                         # save_model (a collective)

It trains as the same model does with transformers' Trainer in one process, whose batch is the
per-device batch times the data-parallel replicas: the same losses, gradient norms, evaluation
and weights. (On a mesh, an evaluation set whose last batch leaves a replica short is padded by
accelerate, as under DDP, and the padded batch's mean loss differs from one process's.)

What it changes (for a model parallelized over two or more ranks; any other model trains as
with transformers' Trainer):

- accelerate never wraps the model in DDP or FSDP, which would take the ranks' shards for copies
  of one tensor; each tensor-parallel group is one data-parallel replica and gets the same
  batches; gradient clipping uses the global norm; evaluation and the count of input tokens
  seen count each sample once (see accelerate_layout); logits returned beside a loss computed
  over vocabulary shards are gathered whole before they reach ``compute_metrics``;
- ``save_model`` (and each checkpoint) writes the whole tensors (``autoshard.full_state_dict``),
  a directory ``from_pretrained`` loads into the unsharded model, and resuming loads each
  rank's part of them;
- a checkpoint holds each rank's own optimizer state, ``optimizer.rank{r}-of-{n}.pt``: it resumes
  exactly at the same ranks and layout, and refuses any other;
- TRL's fused LM head (SFTTrainer's and DPOTrainer's default), which reads the head's weight
  itself, computes its log-probabilities, entropy and top-1 flags over the vocabulary shards
  (see trl_heads);
- on a ("dp", "tp") mesh whose optimizer state parallelize partitions over "dp", the default
  AdamW is ``autoshard.optim.AdamW`` (torch's steps whole tensors and is refused there).

FSDP and DeepSpeed (``fsdp=``, ``deepspeed=``) are refused: their sharding takes autoshard's
shards for whole parameters. ``AutoshardTrainerMixin`` does the same for a subclass of
transformers.Trainer (``class MyTrainer(AutoshardTrainerMixin, SFTTrainer)``).
"""

import functools
import os
import warnings
from typing import Optional

import torch
import transformers

from ..core.parallel_state import state_of
from ..state.unsharded import full_state_dict
from ..state.state_views import unwrap_shard_views
from .accelerate_layout import Layout, adapt, layout_of
from ..optim import AdamW
from .trl_heads import fuse_over_shards
from ..runtime.loss_parallel import gather_logits

__all__ = ["AutoshardTrainerMixin", "Trainer"]

_SCHEDULER = "scheduler.pt"


def _optimizer_file(layout: Layout) -> str:
    return f"optimizer.rank{layout.rank}-of-{layout.tp_size * layout.dp_size}.pt"


class AutoshardTrainerMixin:
    """The changes listed in this module's docstring, for a subclass of transformers.Trainer."""

    _autoshard_layout: Optional[Layout] = None

    # -- the accelerator --------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        layout = layout_of(self.model)
        if layout is not None:
            for option in ("fsdp", "deepspeed"):
                if getattr(self.args, option, None):
                    raise ValueError(f"autoshard.integrations.Trainer: TrainingArguments({option}=...) shards the "
                                     "parameters again, taking autoshard's shards for whole tensors; leave it unset "
                                     "(autoshard splits the model, and a ('dp', 'tp') mesh adds data parallelism)")
        self._autoshard_layout = layout
        super().create_accelerator_and_postprocess()
        if layout is not None:
            adapt(self.accelerator, self.model, layout)
            # Trainer bound accelerate's own gather_for_metrics before it was adapted.
            self.gather_function = functools.partial(self.accelerator.gather_for_metrics,
                                                     use_gather_object=self.args.eval_use_gather_object)

    def get_tp_size(self) -> int:
        """The ranks that share one batch: Trainer divides token counts and the total batch by it."""
        return self._autoshard_layout.tp_size if self._autoshard_layout is not None else super().get_tp_size()

    def _track_num_input_tokens(self, inputs) -> None:
        # Trainer sums the tokens of every rank's batch; the ranks of one tensor-parallel group share one.
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        if self._autoshard_layout is not None:
            seen = self.state.num_input_tokens_seen - before
            self.state.num_input_tokens_seen = before + seen // self._autoshard_layout.tp_size

    # -- the optimizer ----------------------------------------------------------------------
    def create_optimizer(self, model=None):
        state = state_of(self.model)
        partitioned = state is not None and bool(state.partitions)
        if self.optimizer is None and self.optimizer_cls_and_kwargs is None and partitioned:
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model if model is None else model)
            if cls is torch.optim.AdamW:
                # The same update; it also steps the pieces of the state partitioned over "dp".
                kwargs = {k: v for k, v in kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")}
                self.optimizer_cls_and_kwargs = (AdamW, kwargs)
        return super().create_optimizer(model)

    # -- the loss ---------------------------------------------------------------------------
    def compute_loss(self, model, inputs, *args, **kwargs):
        # TRL's trainers give the model (and a reference model) a fused LM head at construction,
        # reading the head's weight itself: over a vocabulary shard it is computed over the shards.
        for candidate in (self.model, getattr(self, "ref_model", None)):
            if candidate is not None and state_of(candidate) is not None:
                base = candidate.get_base_model() if hasattr(candidate, "get_base_model") else candidate
                fuse_over_shards(base)
        return super().compute_loss(model, inputs, *args, **kwargs)

    # -- evaluation -------------------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if self._autoshard_layout is not None and logits is not None:
            if isinstance(logits, torch.Tensor):
                logits = gather_logits(self.model, logits)
            elif isinstance(logits, tuple) and logits and isinstance(logits[0], torch.Tensor):
                logits = (gather_logits(self.model, logits[0]),) + logits[1:]
        return loss, logits, labels

    # -- saving and resuming ----------------------------------------------------------------
    def _save(self, output_dir=None, state_dict=None) -> None:
        # Called on every rank (save_model, checkpoints); the gather is a collective.
        if self._autoshard_layout is not None and state_dict is None:
            state_dict = full_state_dict(self.model)
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        layout = self._autoshard_layout
        if layout is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        saved = {"rank": layout.rank, "tp_size": layout.tp_size, "dp_size": layout.dp_size,
                 "optimizer": unwrap_shard_views(self.optimizer.state_dict())}
        torch.save(saved, os.path.join(output_dir, _optimizer_file(layout)))
        if self.args.should_save:
            with warnings.catch_warnings(record=True):
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: Optional[str]) -> None:
        layout = self._autoshard_layout
        if layout is None or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, _optimizer_file(layout))
        found = sorted(name for name in os.listdir(checkpoint) if name.startswith("optimizer"))
        if not os.path.isfile(path):
            raise ValueError(f"autoshard.integrations.Trainer: {checkpoint} holds no optimizer state for rank "
                             f"{layout.rank} of {layout.tp_size * layout.dp_size} (it holds {found}): a checkpoint "
                             "resumes at the number of ranks and the ('dp', 'tp') layout that saved it")
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if (saved["rank"], saved["tp_size"], saved["dp_size"]) != (layout.rank, layout.tp_size, layout.dp_size):
            raise ValueError(f"autoshard.integrations.Trainer: {path} was saved by rank {saved['rank']} with "
                             f"tp={saved['tp_size']}, dp={saved['dp_size']}; this run has tp={layout.tp_size}, "
                             f"dp={layout.dp_size}: resume with the layout that saved it")
        self.optimizer.load_state_dict(saved["optimizer"])
        with warnings.catch_warnings(record=True):
            self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, _SCHEDULER), weights_only=True))


class Trainer(AutoshardTrainerMixin, transformers.Trainer):
    """transformers.Trainer for a model parallelized by autoshard (see this module's docstring)."""
