"""Stage 6: per-device layouts of every tensor, and the collectives that convert them."""
