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


KNOWN_FAILURES = [
    # `B, T, C = x.shape` read from a tensor split on C, then `q.view(B, T, nh, C // nh)` of a
    # whole (partial-sum) q: the view keeps the local C.
    KnownFailure("a size read from a split tensor reshapes a whole one (likely materialize/ or emit/: local sizes)",
                 re.compile(r"internal error: the dry run of the emitted code failed: .*shape '\[[\d, ]+\]' is "
                            r"invalid for input of size \d+")),
]


def known_failure(reason: str, model: DrawnModel) -> str | None:
    """The name of the known bug a failure matches, if any."""
    return next((k.name for k in KNOWN_FAILURES if k.matches(reason, model)), None)
