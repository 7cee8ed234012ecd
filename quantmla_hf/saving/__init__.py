"""Writing checkpoints: atomic, checked output folders and the QuantMLA model card."""
