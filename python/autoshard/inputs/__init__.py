"""Example inputs for planning: made from a Hugging Face config (text, images, audio) or from a module's forward signature, and copied onto the meta device."""
