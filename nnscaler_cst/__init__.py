"""nnscaler-rewrite: turn a single-device PyTorch model file into explicit per-rank parallel source."""

__version__ = "0.1.0"
