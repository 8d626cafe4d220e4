"""Tool bugs the fuzzer found and benchmarks/FUZZ.md documents, with their minimal models.

The seeded CI test (tests/test_fuzz.py) passes over a failure matching one of these, so that a
known, open bug does not stop CI; any other failure still fails it. The benchmark counts every
failure, known or not. Remove an entry when its bug is fixed: the test then checks it again.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .models import DrawnModel


@dataclass(frozen=True)
class KnownFailure:
    name: str                 # what goes wrong, and the module likely at fault
    reason: re.Pattern        # matched against the runner's Outcome.reason

    def matches(self, reason: str, model: DrawnModel) -> bool:
        return bool(self.reason.search(reason))


KNOWN_FAILURES: list[KnownFailure] = []      # none open: add one with its minimal model when found


def known_failure(reason: str, model: DrawnModel) -> str | None:
    """The name of the known bug a failure matches, if any."""
    return next((k.name for k in KNOWN_FAILURES if k.matches(reason, model)), None)
