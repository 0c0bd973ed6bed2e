"""autoshard with the training tools people already use.

``from autoshard.integrations import Trainer``: transformers.Trainer for a parallelized model
under torchrun (hf_trainer). Importing this package imports transformers and accelerate.
"""

from .hf_trainer import AutoshardTrainerMixin, Trainer

__all__ = ["AutoshardTrainerMixin", "Trainer"]
