"""A JSON number's digits held to what an IEEE double carries, where a JSON grammar leaves them unbounded.

JSON's grammar puts no bound on a number's length, so a JSON-schema constraint allows `0.3333...` forever, and
a model that starts repeating a digit can run to max_tokens inside the number: an output cut there is no JSON.
I-JSON (RFC 7493) asks that numbers carry no more precision or range than a double. Here, once a number has
17 significant digits (any double round-trips in 17; a larger magnitude takes an exponent, as `1e+21`), 324
zeros after its point before the first significant one (past a double's smallest subnormal), or 3 exponent
digits, a further digit is not offered where the grammar lets the number go on otherwise or end (engine/
grammar_mask.py applies that). An integer schema gets I-JSON's bounds in the schema itself
(engine/structured/params.py), well inside this.

Plain Python over the token's bytes (no torch): the scanner follows JSON's lexical states (inside a string, an
escape, a number's integer part, fraction or exponent), so digits inside strings never count.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_SIGNIFICANT_DIGITS = 17
MAX_FRACTION_LEADING_ZEROS = 324
MAX_EXPONENT_DIGITS = 3

_OUTSIDE, _STRING, _ESCAPE, _INTEGER, _FRACTION, _EXPONENT = range(6)
_DIGITS = frozenset(b"0123456789")


@dataclass(frozen=True)
class TokenBytes:
    """A tokenizer's tokens as bytes (index: token id), and the ids of those whose text starts with a digit."""

    pieces: tuple[bytes, ...]
    digit_led: tuple[int, ...]

    @classmethod
    def of(cls, pieces: list[bytes]) -> "TokenBytes":
        return cls(tuple(pieces), tuple(i for i, p in enumerate(pieces) if p[:1] and p[0] in _DIGITS))


class NumberScanner:
    """One sequence's place in JSON text, advanced a token at a time: whether another digit would carry more
    than a double does (`digits_closed`)."""

    __slots__ = ("tokens", "_state", "_significant", "_zeros", "_exponent")

    def __init__(self, tokens: TokenBytes):
        self.tokens = tokens
        self._state = _OUTSIDE
        self._significant = self._zeros = self._exponent = 0

    def advance(self, token_id: int) -> None:
        pieces = self.tokens.pieces
        for c in pieces[token_id] if token_id < len(pieces) else b"":
            self._byte(c)

    def _byte(self, c: int) -> None:
        s = self._state
        if s == _STRING:
            self._state = _ESCAPE if c == 0x5C else _OUTSIDE if c == 0x22 else _STRING
        elif s == _ESCAPE:
            self._state = _STRING
        elif c in _DIGITS:
            if s == _INTEGER:
                self._significant += self._significant > 0 or c != 0x30
            elif s == _FRACTION:
                if self._significant == 0 and c == 0x30:
                    self._zeros += 1
                else:
                    self._significant += 1
            elif s == _EXPONENT:
                self._exponent += 1
            else:  # a number starts
                self._state, self._significant, self._zeros = _INTEGER, int(c != 0x30), 0
        elif c == 0x2E and s == _INTEGER:
            self._state = _FRACTION
        elif c in b"eE" and s in (_INTEGER, _FRACTION):
            self._state, self._exponent = _EXPONENT, 0
        elif c in b"+-" and s == _EXPONENT:
            pass
        else:
            self._state = _STRING if c == 0x22 else _OUTSIDE

    @property
    def digits_closed(self) -> bool:
        s = self._state
        if s == _INTEGER or s == _FRACTION:
            return self._significant >= MAX_SIGNIFICANT_DIGITS or self._zeros >= MAX_FRACTION_LEADING_ZEROS
        return s == _EXPONENT and self._exponent >= MAX_EXPONENT_DIGITS

    def copy(self) -> "NumberScanner":
        """Where it is now."""
        other = NumberScanner(self.tokens)
        other._state, other._significant, other._zeros, other._exponent = self._snapshot()
        return other

    def _snapshot(self) -> tuple[int, int, int, int]:
        return self._state, self._significant, self._zeros, self._exponent
