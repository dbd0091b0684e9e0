"""The copy atlas: what each PyTorch copy operation really does, one proof per row of ``docs/copy-atlas.md``."""
