"""Tokenizers built from GGUF metadata give transformers' ids; chat templates render as HF does, sandboxed."""
from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from kvserve.models import tokenizer as tokmod
from kvserve.models.tokenizer import ChatTemplateError, Tokenizer, read_gguf_metadata

pytestmark = pytest.mark.real_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

CORPUS = [
    "",
    " ",
    "  ",
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces",
    "trailing spaces   ",
    "multiple    spaces   inside  words",
    "a" * 40 + " " * 40 + "b",
    " " * 33,
    "\n" * 35,
    "\t\ttabs\tand\r\nCRLF\r\n",
    "\n\n\nnewlines\n",
    "1234567890 3.14159 -42 1e10 0x1F 1,000,000",
    "def f(x):\n    return x ** 2  # square\n",
    'int main() { printf("%d\\n", 42); return 0; }',
    "Café naïve résumé façade Ünïcödé",
    "日本語のテキストです。東京",
    "中文测试，你好世界",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "👨‍👩‍👧‍👦 family 🇫🇷🇯🇵 flags 😀",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𓀀 ꙮ",
    '<div class="x"><p>Hi &amp; bye</p></div><h1>Title</h1>\n<br>',
    "https://example.com/path?q=1&r=two#frag",
    "nbsp\u00a0thin\u2009zero\u200bwidth\u200djoin\ufeff",
    "ÿ\x00\x01 control chars",
    "don't won't I'm we'll they've",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <|endoftext|>",
    "[multimodal] <start_of_image>",
]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi there."},
    {"role": "user", "content": "What is 2+2?"},
]


def _hf(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_gguf_path):
    return _hf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_gguf_path):
    return _hf(gemma3_gguf_path)  # ~15-20 s: transformers rebuilds 515k merges in Python


@pytest.fixture(params=["smollm2", "gemma3"])
def pair(request):
    """(ours, transformers') for each model."""
    return request.getfixturevalue(f"{request.param}_tokenizer"), request.getfixturevalue(f"hf_{request.param}")


# -- ids ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_ids_match_transformers(pair, add_special_tokens):
    ours, ref = pair
    got = ours.encode_batch(CORPUS, add_special_tokens=add_special_tokens)
    mismatches = [
        (text, ids, ref.encode(text, add_special_tokens=add_special_tokens))
        for text, ids in zip(CORPUS, got)
        if ids != ref.encode(text, add_special_tokens=add_special_tokens)
    ]
    assert not mismatches
    assert [ours.encode(t, add_special_tokens=add_special_tokens) for t in CORPUS] == got


def test_decode_round_trips_and_matches_transformers(pair):
    ours, ref = pair
    for text in CORPUS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text
        assert ours.decode(ids) == ref.decode(ids)
        with_bos = ours.encode(text)
        assert ours.decode(with_bos, skip_special_tokens=True) == ref.decode(with_bos, skip_special_tokens=True)


def test_special_ids_and_flags(smollm2_tokenizer, gemma3_tokenizer):
    s, g = smollm2_tokenizer, gemma3_tokenizer
    assert (s.bos_token_id, s.eos_token_id, s.pad_token_id, s.add_bos_token, s.vocab_size) == (1, 2, 2, False, 49152)
    assert s.encode("Hi")[0] != 1
    assert {2} <= s.eos_token_ids
    assert (g.bos_token_id, g.eos_token_id, g.pad_token_id, g.add_bos_token, g.vocab_size) == (2, 1, 0, True, 262144)
    assert g.eos_token_ids >= {1, 106}
    assert g.encode("Hi")[0] == 2 and g.encode("Hi", add_special_tokens=False)[0] != 2
    assert {0, 1, 2, 105, 106} <= set(g.all_special_ids) and {1, 2} <= set(s.all_special_ids)
    assert g.convert_ids_to_tokens([2, 105, 106]) == ["<bos>", "<start_of_turn>", "<end_of_turn>"]
    assert g.id_to_token(107) == "\n" and g.token_to_id("<end_of_turn>") == 106
    assert g.decode(g.encode("<start_of_turn>hi<end_of_turn>"), skip_special_tokens=True) == "hi"


def test_build_time_and_metadata_reader(gemma3_gguf_path):
    t0 = time.perf_counter()
    meta = read_gguf_metadata(gemma3_gguf_path)
    assert time.perf_counter() - t0 < 2.0  # gguf.GGUFReader takes ~11 s on this file
    assert meta["general.architecture"] == "gemma3" and len(meta["tokenizer.ggml.tokens"]) == 262144
    assert meta["tokenizer.ggml.scores"].dtype == np.float32 and meta["gemma3.block_count"] == 18


def test_vectorized_merge_candidates_equal_python_path():
    rng = np.random.default_rng(0)
    alphabet = list("ab▁c中😀 ")
    tokens = list(dict.fromkeys(alphabet + ["".join(rng.choice(alphabet, size=rng.integers(1, 7))) for _ in range(3000)]))
    tokens += [tokens[5]]  # a duplicate spelling is not a vocab key
    vocab = tokmod._first_index_vocab(tokens)
    fast = tokmod._split_candidates_numpy(tokens, vocab)
    slow = tokmod._split_candidates_python(tokens, vocab)
    assert fast is not None
    assert sorted(zip(*map(np.ndarray.tolist, fast))) == sorted(zip(*map(np.ndarray.tolist, slow)))
    assert tokmod._split_candidates_numpy(["a\x00b", "a", "\x00b"], {"a\x00b": 0, "a": 1, "\x00b": 2}) is None


def _write_gguf(path, arch, kv):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for method, *args in kv:
        getattr(writer, method)(*args)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_bpe_gguf(tmp_path_factory):
    """A byte-level BPE GGUF with llama3's pre-tokenizer, an eot id and BOS on (llama3 style)."""
    alphabet = list(tokmod._bytes_to_unicode().values())
    merges = ["1 2", "12 3", "4 5", "Ġ t", "h e", "Ġt he"]
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"]
    tokens = alphabet + [m.replace(" ", "") for m in merges] + specials
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    n = len(tokens)
    kv = [("add_tokenizer_model", "gpt2"), ("add_tokenizer_pre", "llama-bpe"), ("add_token_list", tokens),
          ("add_token_types", types), ("add_token_merges", merges), ("add_bos_token_id", n - 3),
          ("add_eos_token_id", n - 1), ("add_eot_token_id", n - 2), ("add_add_bos_token", True)]
    return _write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-bpe.gguf", "llama", kv)


def test_tiny_byte_level_gguf_and_gguf_reader(tiny_bpe_gguf):
    gguf = pytest.importorskip("gguf")
    tok = Tokenizer.from_gguf(tiny_bpe_gguf)
    assert Tokenizer.from_gguf(gguf.GGUFReader(str(tiny_bpe_gguf))).encode("12345 the") == tok.encode("12345 the")
    n = tok.vocab_size
    # llama3's regex splits digits in groups of three: "123" "45", not "12" "345".
    assert tok.convert_ids_to_tokens(tok.encode("12345 the")) == ["<|begin_of_text|>", "123", "45", "Ġthe"]
    assert tok.bos_token_id == n - 3 and tok.add_bos_token
    assert tok.eos_token_ids == {n - 1, n - 2}
    assert tok.decode(tok.encode("héllo 12345 the<|eot_id|>"), skip_special_tokens=True) == "héllo 12345 the"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]).startswith("<|im_start|>user")  # ChatML fallback


def _tiny_spm(tmp_path, arch, add_space_prefix):
    # "ab" comes before "bc" in the file, but "bc" scores higher: score order and file order disagree.
    normal = [("\u2581", 0.0), ("a", 0.0), ("b", 0.0), ("c", 0.0), ("ab", -2.0), ("bc", -1.0), ("\u2581a", -3.0)]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + [t for t, _ in normal] + ["  ", "   "]
    scores = [0.0] * 259 + [s for _, s in normal] + [0.0, 0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(normal) + [4, 4]  # space runs: user-defined, stored as spaces
    kv = [("add_tokenizer_model", "llama"), ("add_tokenizer_pre", "default"), ("add_token_list", tokens),
          ("add_token_scores", scores), ("add_token_types", types), ("add_bos_token_id", 1), ("add_eos_token_id", 2),
          ("add_unk_token_id", 0), ("add_add_space_prefix", add_space_prefix)]
    return Tokenizer.from_gguf(_write_gguf(tmp_path / f"{arch}-{add_space_prefix}.gguf", arch, kv))


def test_tiny_sentencepiece_gguf(tmp_path):
    llama = _tiny_spm(tmp_path, "llama", add_space_prefix=True)
    gemma = _tiny_spm(tmp_path, "gemma3", add_space_prefix=False)
    # Merge priority: llama files rank by score (bc first), Gemma files by file position (ab first).
    assert llama.convert_ids_to_tokens(llama.encode("abc", add_special_tokens=False)) == ["\u2581a", "bc"]
    assert gemma.convert_ids_to_tokens(gemma.encode("abc", add_special_tokens=False)) == ["ab", "c"]
    assert llama.add_bos_token and llama.encode("a")[0] == 1  # llama.cpp's default for SentencePiece vocabularies
    # Byte fallback for characters outside the vocabulary, and exact round trips.
    assert gemma.convert_ids_to_tokens(gemma.encode("é", add_special_tokens=False)) == ["<0xC3>", "<0xA9>"]
    for text in ["abc é ab", "c  ba", "😀a"]:
        assert gemma.decode(gemma.encode(text, add_special_tokens=False)) == text
        assert llama.decode(llama.encode(text), skip_special_tokens=True) == text
    assert gemma.encode("a   b", add_special_tokens=False)[1] == gemma.token_to_id("\u2581" * 3)


# -- chat templates ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("messages", [MESSAGES, MESSAGES[1:], MESSAGES[1:2]])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smollm2_tokenizer, hf_smollm2, messages, add_generation_prompt):
    ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == ref
    ids = smollm2_tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    assert ids == hf_smollm2.encode(ref, add_special_tokens=False)


def test_gemma_template_renders_expected_string(gemma3_tokenizer, hf_gemma3):
    text = gemma3_tokenizer.apply_chat_template(MESSAGES)
    assert text == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHello!<end_of_turn>\n"
        "<start_of_turn>model\nHi there.<end_of_turn>\n"
        "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    # Same template through transformers' own Jinja environment gives the same text.
    ref = hf_gemma3.apply_chat_template(
        MESSAGES, chat_template=gemma3_tokenizer.chat_template, add_generation_prompt=True, tokenize=False
    )
    assert text == ref
    ids = gemma3_tokenizer.encode_chat(MESSAGES)
    tail = gemma3_tokenizer.encode("<start_of_turn>model\n", add_special_tokens=False)
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids[-len(tail) :] == tail
    assert ids == [2] + gemma3_tokenizer.encode(text[len("<bos>"):], add_special_tokens=False)
    assert gemma3_tokenizer.apply_chat_template(MESSAGES[1:2], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHello!<end_of_turn>\n"
    )
    with pytest.raises(ChatTemplateError, match="alternate"):
        gemma3_tokenizer.apply_chat_template([MESSAGES[1], MESSAGES[1]])


def test_content_parts_are_joined_and_bad_messages_rejected(smollm2_tokenizer):
    tok = smollm2_tokenizer
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "a\nb<|im_end|>" in tok.apply_chat_template(parts)
    bad = [
        [],
        "hello",
        [{"role": "wizard", "content": "x"}],
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        ["not a dict"],
    ]
    for messages in bad:
        with pytest.raises(ValueError):
            tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{% set x = messages.pop() %}",
        "{{ messages[0].update({'content': 'pwned'}) }}",
        "{{ raise_exception.__globals__['os'] }}",
        "{{ self.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os }}",
    ],
)
def test_sandbox_blocks_attribute_tricks(smollm2_tokenizer, template):
    with pytest.raises(ChatTemplateError, match="unsafe"):
        smollm2_tokenizer.apply_chat_template(MESSAGES, chat_template=template)


def test_template_helpers(smollm2_tokenizer):
    tpl = "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}|{% if x %}{{ raise_exception('no ' + x) }}{% endif %}"
    out = smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "é"}], chat_template=tpl)
    assert out == '<|im_start|>|<|im_end|>|[{"role": "user", "content": "é"}]|'
    with pytest.raises(ChatTemplateError, match="no way"):
        smollm2_tokenizer.apply_chat_template([{"role": "user", "content": "é"}], chat_template=tpl, x="way")


def test_chatml_fallback_when_no_template(smollm2_gguf_path):
    meta = read_gguf_metadata(smollm2_gguf_path)
    del meta["tokenizer.chat_template"]
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# -- HF directories ----------------------------------------------------------------------------------------------------


def test_from_hf_dir_saved_by_transformers(hf_smollm2, smollm2_tokenizer, tmp_path):
    hf_smollm2.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode_batch(CORPUS) == smollm2_tokenizer.encode_batch(CORPUS)
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, False)
    assert 2 in tok.eos_token_ids
    assert tok.apply_chat_template(MESSAGES) == smollm2_tokenizer.apply_chat_template(MESSAGES)


def test_from_hf_dir_config_overrides(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": True,
              "chat_template": [{"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.add_bos_token and tok.encode("Hi") == [1] + smollm2_tokenizer.encode("Hi")
    assert tok.eos_token_ids >= {0, 2}
    assert tok.apply_chat_template([{"role": "user", "content": "yo"}]) == "<|im_start|>yo"
    assert tok.encode_chat([{"role": "user", "content": "yo"}]) == [1] + smollm2_tokenizer.encode("yo")
