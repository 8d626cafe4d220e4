"""Stage 7: rewrite the user's source with LibCST, and write the output directory."""
