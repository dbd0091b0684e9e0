"""The faults a demanding user tries, run against the recipes and the post-hoc command: ``tools/faults/run.py``."""
