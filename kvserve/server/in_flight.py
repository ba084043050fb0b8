"""The completion responses not fully sent yet, which a drain waits for (server/state.py): local calls and
calls relayed from a peer region alike.

One owner of the count: a call holds a place with `with in_flight.hold() as place:`, and leaving the block
gives it back however it is left (a return, an exception), unless the call passed the place on to its
streaming response, whose end then releases it (once, however often it is asked).
"""
from __future__ import annotations

import contextlib
from typing import Iterator


class Place:
    """One call's place in the count."""

    def __init__(self, owner: "InFlight"):
        self._owner = owner
        self._held = True
        self.passed_on = False
        self._on_release: list = []

    def on_release(self, fn) -> None:
        """Call `fn` when the place is given back (the call's model may then be unloaded: service/residency.py)."""
        self._on_release.append(fn)

    def pass_on(self) -> None:
        """The call's response now owns the place: its end calls `release`, not the `with` block."""
        self.passed_on = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._owner._count -= 1
            for fn in self._on_release:
                fn()


class InFlight:
    def __init__(self) -> None:
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    @contextlib.contextmanager
    def hold(self) -> Iterator[Place]:
        self._count += 1
        place = Place(self)
        try:
            yield place
        finally:
            if not place.passed_on:
                place.release()
