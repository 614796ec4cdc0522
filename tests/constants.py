"""Sizes shared by the tiny test models (no pytest import: the GPU check reuses the builders)."""

VOCAB = 64
NUM_LABELS = 3
