"""Resume tokens (service/resume.py): a token names a stream's delivered tokens by count and digest; any
malformed one is a 400 naming Last-Event-ID."""
from __future__ import annotations

import pytest


def test_resume_tokens_round_trip_and_malformed_ones_are_400s():
    from kvserve.engine.errors import InvalidRequest
    from kvserve.service.resume import ResumePoint, TokenDigest

    d = TokenDigest.of([5, 6, 7])
    p = d.point()
    assert ResumePoint.parse(p.encode()) == p and p.count == 3
    assert TokenDigest.of([5, 6, 8]).point() != p and TokenDigest.of([5, 6]).point() != p
    for bad in ("", "r1.3", "r2.3." + "0" * 16, "r1.0." + "0" * 16, "r1.x." + "0" * 16, "r1.3." + "g" * 16):
        with pytest.raises(InvalidRequest):
            ResumePoint.parse(bad)
