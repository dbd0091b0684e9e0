"""Hydra-configured Lightning recipes, one file each; run one with ``python train.py +recipe=NAME``."""
