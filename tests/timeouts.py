"""Wall-clock limits in tests are hang guards only, all scaled by one factor.

A limit in a test exists so that a hang fails the test instead of the CI job: it must never trip on a machine that is
merely busy. The base values are generous (a 2-core machine at load 25 runs ~10x slower than a quiet one) and
``HLAT_TEST_TIMEOUT_FACTOR`` (default 1) multiplies every one of them, for a CI runner slower still:

    HLAT_TEST_TIMEOUT_FACTOR=3 make test

No test asserts on elapsed time or speed (benchmarks live in bench/). Timeouts that are the subject of a test (a
handshake that must give up, a collective timeout that must reach gloo) keep their own small values; the guards
around them scale.
"""

from __future__ import annotations

import os


def timeout_factor() -> float:
    """``HLAT_TEST_TIMEOUT_FACTOR`` (default 1; must be positive)."""
    raw = os.environ.get("HLAT_TEST_TIMEOUT_FACTOR", "1")
    try:
        factor = float(raw)
    except ValueError:
        raise ValueError(f"HLAT_TEST_TIMEOUT_FACTOR={raw!r}: not a number") from None
    if not factor > 0:
        raise ValueError(f"HLAT_TEST_TIMEOUT_FACTOR={raw!r}: must be positive")
    return factor


def hang_guard(seconds: float) -> float:
    """``seconds`` (a generous base: ~10x what the step takes on a quiet 2-core machine) times the factor."""
    return seconds * timeout_factor()
