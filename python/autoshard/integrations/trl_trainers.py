"""TRL's trainers for a parallelized model: ``from autoshard.integrations import SFTTrainer``
(or ``DPOTrainer``) in place of TRL's, the rest of the one-GPU script unchanged. Each is TRL's
trainer with ``AutoshardTrainerMixin`` (see hf_trainer and trl_heads)."""

import trl

from .hf_trainer import AutoshardTrainerMixin

__all__ = ["DPOTrainer", "SFTTrainer"]


class SFTTrainer(AutoshardTrainerMixin, trl.SFTTrainer):
    """trl.SFTTrainer for a model parallelized with autoshard."""


class DPOTrainer(AutoshardTrainerMixin, trl.DPOTrainer):
    """trl.DPOTrainer for a model parallelized with autoshard."""
