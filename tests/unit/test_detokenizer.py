"""Streaming detokenization: deltas add up to the full decode; stop strings are cut across token boundaries."""
from __future__ import annotations

import random

import pytest

from kvserve.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.real_model

TEXTS = [
    "plain ascii, with numbers 12345 and  two spaces.",
    "emoji 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵 😀!",
    "日本語のテキストです。中文测试，你好世界",
    "rare glyphs 𓀀 ꙮ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 end",
    "Привет мир\n\n  code:\tx = 1\r\n",
    "special <start_of_turn>model\nhi<end_of_turn> and <|im_start|>x<|im_end|> tokens",
]


@pytest.fixture(params=["smollm2", "gemma3"])
def tok(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


def stream(tok, ids, prompt=(), **kwargs):
    d = IncrementalDetokenizer(tok, list(prompt), **kwargs)
    deltas = [d.add_token(i) for i in ids]
    deltas.append(d.flush())
    return d, deltas


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_add_up_to_full_decode(tok, skip):
    prompt = tok.encode("Say something:")
    held = 0
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        d, deltas = stream(tok, ids, prompt, skip_special_tokens=skip)
        full = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == d.output_text == full
        assert d.token_ids == ids and not d.stopped
        held += deltas[:-1].count("")
    assert held > 0  # some characters span several tokens (byte tokens / byte fallback) and were held


def test_byte_fallback_is_held_until_the_run_ends(gemma3_tokenizer):
    tok = gemma3_tokenizer
    ids = tok.encode("a𓀀b", add_special_tokens=False)
    assert any(i in tok.byte_fallback_ids for i in ids)
    d, deltas = stream(tok, ids)
    assert "".join(deltas) == "a𓀀b" and "\ufffd" not in "".join(deltas)
    # An invalid run decodes as U+FFFD per byte, as the full decode does; a valid byte before it is not leaked early.
    bad = [tok.token_to_id("<0x6C>"), tok.token_to_id("<0xE4>"), tok.token_to_id("<0xB8>"), tok.encode("x", False)[0]]
    d, deltas = stream(tok, bad)
    assert "".join(deltas) == tok.decode(bad) == "\ufffd\ufffd\ufffdx"


def test_random_ids_with_flush(tok):
    """Arbitrary ids (many byte tokens, invalid UTF-8, specials): deltas + flush still equal the full decode."""
    rng = random.Random(1234)
    byte_ids = sorted(tok.byte_fallback_ids) or [tok.token_to_id(c) for c in "ÃĤ¸ł"]
    for _ in range(40):
        ids = [rng.choice(byte_ids) if rng.random() < 0.5 else rng.randrange(tok.vocab_size) for _ in range(30)]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(8)]
        for skip in (True, False):
            d, deltas = stream(tok, ids, prompt, skip_special_tokens=skip)
            assert "".join(deltas) == d.output_text == tok.decode(ids, skip_special_tokens=skip)


def test_window_stays_short(tok):
    """O(1) per token: every decode call sees a bounded window, however long the output."""

    class Counting:
        def __init__(self, inner):
            self.inner, self.longest, self.calls = inner, 0, 0
            self.byte_fallback_ids, self.all_special_ids = inner.byte_fallback_ids, inner.all_special_ids

        def decode(self, ids, skip_special_tokens=False):
            self.longest, self.calls = max(self.longest, len(ids)), self.calls + 1
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("lorem ipsum dolor 中文 😀 " * 150, add_special_tokens=False)
    counting = Counting(tok)
    d, deltas = stream(counting, ids, tok.encode("prompt " * 100))
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert counting.longest <= 80 and counting.calls <= 2 * len(ids) + 2


def test_stop_string_across_token_boundaries(tok):
    text = "The answer is 42. STOP here and more text"
    ids = tok.encode(text, add_special_tokens=False)
    d, deltas = stream(tok, ids, stop=["2. ST"])  # spans four tokens in both vocabularies
    assert d.stop_reason == "2. ST" and "".join(deltas) == d.output_text == "The answer is 4"
    d, deltas = stream(tok, ids, stop=["STOP", "never"])
    assert d.stopped and d.stop_reason == "STOP"
    assert "".join(deltas) == d.output_text == "The answer is 42. "
    assert not any("S" in delta for delta in deltas)  # the start of the stop string was held back, never emitted
    assert d.add_token(ids[0]) == "" and d.flush() == ""

    d, deltas = stream(tok, ids, stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(deltas) == d.output_text == "The answer is 42. STOP"


def test_stop_string_inside_one_token_and_earliest_wins(tok):
    ids = tok.encode("hello world, goodbye world", add_special_tokens=False)
    d, deltas = stream(tok, ids, stop=["ood", "llo w"])  # "llo w" starts first; "ood" is mid-token
    assert d.stop_reason == "llo w" and "".join(deltas) == "he"
    d, deltas = stream(tok, ids, stop=["ood"])
    assert "".join(deltas) == "hello world, g"


def test_held_prefix_is_released_when_disambiguated(tok):
    ids = tok.encode("wait... done", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["...!"])
    deltas = [d.add_token(i) for i in ids]
    flushed = d.flush()
    assert not d.stopped and "".join(deltas) + flushed == "wait... done"
    # Text ending in a possible stop prefix is held until flush releases it.
    ids = tok.encode("wait..", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], stop=["...!"])
    emitted = "".join(d.add_token(i) for i in ids)
    assert emitted == "wait" and d.flush() == ".." and d.output_text == "wait.."


def test_skip_special_tokens(tok):
    end = tok.token_to_id("<end_of_turn>") or tok.token_to_id("<|im_end|>")
    ids = tok.encode("Hi", add_special_tokens=False) + [end] + tok.encode(" there", add_special_tokens=False)
    _, kept = stream(tok, ids, skip_special_tokens=False)
    _, skipped = stream(tok, ids, skip_special_tokens=True)
    assert "".join(kept) == "Hi" + tok.id_to_token(end) + " there"
    assert "".join(skipped) == "Hi there"
