"""Loading Hugging Face safetensors checkpoints into parallelized models, slice by slice."""

from .load import load_pretrained

__all__ = ["load_pretrained"]
