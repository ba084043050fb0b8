"""The number-precision scanner: digits a double carries, counted over JSON's lexical states only (never inside
strings), whatever way the tokenizer splits the text."""
from __future__ import annotations

import pytest

from kvserve.engine.structured.number_precision import (MAX_EXPONENT_DIGITS, MAX_SIGNIFICANT_DIGITS, NumberScanner,
                                             TokenBytes)

# A toy vocabulary: single characters and a few multi-character pieces, as a BPE tokenizer has them.
PIECES = [c.encode() for c in '0123456789.eE+-"\\{}:, abx'] + [b'0.', b'"a', b'9,', b'": ', b'12']
TOKENS = TokenBytes.of(PIECES)


def scan(text: str, split: int = 1) -> NumberScanner:
    s = NumberScanner(TOKENS)
    index = {p: i for i, p in enumerate(PIECES)}
    data, i = text.encode(), 0
    while i < len(data):  # longest piece first, at most `split` bytes
        for n in range(min(split, len(data) - i), 0, -1):
            if data[i:i + n] in index:
                s.advance(index[data[i:i + n]])
                i += n
                break
        else:
            raise AssertionError(f"no piece for {data[i:]!r}")
    return s


def test_digit_led_tokens_are_listed():
    assert {PIECES[i] for i in TOKENS.digit_led} == {c.encode() for c in "0123456789"} | {b"0.", b"9,", b"12"}


@pytest.mark.parametrize("split", [1, 3])
def test_a_fraction_closes_at_a_doubles_significant_digits(split):
    sig = "1234567890123456789"
    assert not scan("0." + sig[:MAX_SIGNIFICANT_DIGITS - 1], split).digits_closed
    assert scan("0." + sig[:MAX_SIGNIFICANT_DIGITS], split).digits_closed
    assert scan("12." + sig[:MAX_SIGNIFICANT_DIGITS - 2], split).digits_closed  # the integer part's count
    assert not scan("0.000000" + sig[:MAX_SIGNIFICANT_DIGITS - 1], split).digits_closed  # leading zeros do not
    assert scan("0." + "0" * 324, split).digits_closed
    assert not scan("-0.5", split).digits_closed


def test_an_integer_part_closes_at_the_same_count():
    assert not scan("-" + "9" * (MAX_SIGNIFICANT_DIGITS - 1)).digits_closed
    assert scan("-" + "9" * MAX_SIGNIFICANT_DIGITS).digits_closed
    assert not scan("0").digits_closed


def test_exponents_close_at_three_digits_and_a_number_ends_at_a_separator():
    assert not scan("1.5e" + "9" * (MAX_EXPONENT_DIGITS - 1)).digits_closed
    assert scan("1.5e+" + "9" * MAX_EXPONENT_DIGITS).digits_closed
    assert scan("2E" + "1" * MAX_EXPONENT_DIGITS).digits_closed
    assert not scan('{"x": 0.' + "3" * 20 + ", ").digits_closed  # the number ended
    assert scan('{"x": 1, "b": 0.' + "3" * 20).digits_closed


def test_digits_inside_strings_never_count():
    assert not scan('"0.' + "3" * 30).digits_closed
    assert not scan('"a\\"0.' + "3" * 30).digits_closed  # an escaped quote does not end the string
    assert scan('"a\\"", 0.' + "3" * 30).digits_closed
    s = scan('{"a": "x", "b": 0.' + "4" * 30, split=3)
    assert s.digits_closed and s.copy().digits_closed
