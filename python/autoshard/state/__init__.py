"""A parallelized model's and its optimizer's state as the tools that read it by name expect: global views, the unsharded state."""
