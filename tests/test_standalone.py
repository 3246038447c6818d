"""The test suite stands alone: a fresh clone has no ``../shared`` (the team's data beside the checkout), so no test
may read it; prompt sets come from the registry or from the tests' own small files."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
OUTSIDE = re.compile(r"parents\[2\]|\.\./shared|/\s*\"shared\"|SHARED_DATA|SHARED_EVAL|EVAL_SOURCE"
                     r"|/work/shared|shared/data")


def test_tests_read_nothing_outside_the_checkout():
    offenders = [f"{p.name}:{i}: {line.strip()}" for p in sorted(TESTS.glob("*.py")) if p.name != Path(__file__).name
                 for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if OUTSIDE.search(line)]
    assert offenders == []
