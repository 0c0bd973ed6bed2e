"""autoshard with the training tools people already use.

``from autoshard.integrations import Trainer``: transformers.Trainer for a parallelized model
under torchrun (hf_trainer); reading Trainer or AutoshardTrainerMixin from this package imports
transformers and accelerate; SFTTrainer and DPOTrainer (trl_trainers) import TRL too. hf_conventions holds what autoshard relies on of transformers'
models, configs and checkpoints, and imports neither, so that the rest of autoshard can read it.
"""

__all__ = ["AutoshardTrainerMixin", "DPOTrainer", "SFTTrainer", "Trainer"]
_TRL = ("DPOTrainer", "SFTTrainer")


def __getattr__(name: str):
    # The Trainer is imported on first use: the package itself must stay importable without
    # transformers, since the rest of autoshard reads hf_conventions from it.
    if name in _TRL:
        from . import trl_trainers

        return getattr(trl_trainers, name)
    if name in __all__:
        from . import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
