"""Stage 1: parse source files with LibCST and locate nodes by position."""
