"""Fuzzed equivalence: small models drawn from a grammar of ops (models.py), each rewritten
under a plan and verified the way a user does (runner.py)."""
