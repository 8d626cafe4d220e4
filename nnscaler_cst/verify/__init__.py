"""Stage 8: prove a rewrite right by running it against the single-device model."""
