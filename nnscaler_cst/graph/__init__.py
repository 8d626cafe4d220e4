"""Stages 3-4a: the op graph of call sites, and the split annotations of each op."""
