"""What autoshard relies on of other libraries: Hugging Face transformers' names and classes, torch's pipelining and data-parallel wrappers. Imports nothing of autoshard."""
