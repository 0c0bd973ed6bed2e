"""autoshard with the training tools people already use.

``from autoshard.integrations import Trainer``: transformers.Trainer for a parallelized model
under torchrun (hf_trainer); reading Trainer or AutoshardTrainerMixin from this package imports
transformers and accelerate; SFTTrainer and DPOTrainer (trl_trainers) import TRL too. What
autoshard relies on of transformers' models, configs and checkpoints is in conventions/.
"""

__all__ = ["AutoshardTrainerMixin", "DPOTrainer", "SFTTrainer", "Trainer"]
_TRL = ("DPOTrainer", "SFTTrainer")


def __getattr__(name: str):
    # The Trainer is imported on first use: the package itself stays importable without
    # transformers, TRL or accelerate.
    if name in _TRL:
        from . import trl_trainers  # noqa: PLC0415  (TRL is optional: imported on first use)

        return getattr(trl_trainers, name)
    if name in __all__:
        from . import hf_trainer  # noqa: PLC0415  (transformers is optional: imported on first use)

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
