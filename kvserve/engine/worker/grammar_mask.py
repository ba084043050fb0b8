"""The token masks of a step's constrained rows, applied to their logits before sampling, or only where needed.

A mask costs the grammar a pass over the vocabulary, per row per step (BENCHMARKS.md has what it costs), while
the token a row would sample unmasked is usually one the grammar allows. Where that token is provably the one
the masked row would give, the row samples unmasked and only checks that one token: a greedy row (the argmax over a subset that holds the overall argmax is that
token), and an unseeded row sampled at a temperature with no top-p, top-k or min-p and no logprobs (kept if
allowed, else sampled again from the masked distribution: together exactly the masked distribution, p(x)/p(A)
for x in A). Seeded rows are masked first, so their draws are the ones the seed promises (one a token, as a
resumed stream replays them); so are rows whose truncation or logprobs depend on the mask.

Each matcher writes its allowed-token bitmask (32 tokens an int32 word) into one host tensor, all rows at once
on llguidance's own thread pool (LLExecutor: the masks of a batch in parallel, without the GIL); the bits are
widened to a boolean mask on the logits' device, and every disallowed token's logit set to -inf. Only the
constrained rows are touched: another request's row is the same bits with or without its neighbours' grammars.

A JSON row whose number has all the digits a double carries (engine/structured/number_precision.py) is masked first, and
its digit-led tokens are taken out of its mask too, unless nothing else would be left (a number the schema's
bounds do not yet let end).

A row whose sequence must take a given token (its thinking budget is spent: engine/reasoning.py) is masked to that
token alone (`force_tokens`); its logprobs, taken from the raw logits, are the model's own.
"""
from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)
_executor = None


def _llexecutor():
    global _executor
    if _executor is None:
        from llguidance import LLExecutor

        _executor = LLExecutor()
    return _executor


def checked_after_sampling(seqs: list, generators: list) -> tuple[list[int], list[int]]:
    """(rows sampled unmasked and checked after, rows masked first) among the rows whose sequence has a grammar."""
    lazy, eager = [], []
    for j, (seq, g) in enumerate(zip(seqs, generators)):
        if seq.grammar is None:
            continue
        p = seq.sampling
        plain = p.greedy or (g is None and p.top_p >= 1.0 and not p.top_k and not p.min_p)
        digits_closed = seq.numbers is not None and seq.numbers.digits_closed
        (lazy if plain and p.logprobs is None and not digits_closed else eager).append(j)
    return lazy, eager


def allowed_tokens(matchers: list, vocab_size: int) -> torch.Tensor:
    """[len(matchers), vocab_size] bool on the host: the tokens each matcher allows next."""
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
    _llexecutor().unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4,
                                          len(matchers))
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS) & 1
    return bits.view(len(matchers), -1)[:, :vocab_size].bool()


# id(TokenBytes) -> (the table, its digit-led token ids): the table is held, so its id is never another's
_digit_led: dict[int, tuple[object, torch.Tensor]] = {}


def _without_more_digits(allowed: torch.Tensor, seqs: list) -> None:
    """Rows whose number has a double's digits lose their digit-led tokens where another token is left."""
    for i, seq in enumerate(seqs):
        if seq.numbers is None or not seq.numbers.digits_closed:
            continue
        table = seq.numbers.tokens
        entry = _digit_led.get(id(table))
        if entry is None:
            entry = _digit_led[id(table)] = (table, torch.tensor(table.digit_led, dtype=torch.long))
        ids = entry[1]
        row = allowed[i].clone()
        row[ids[ids < row.shape[0]]] = False
        if row.any():
            allowed[i] = row


def _after(matcher, drafts: list[int]):
    """A copy of `matcher` past a draft row's drafts (which the scheduler checked it allows)."""
    if not drafts:
        return matcher
    m = matcher.deep_copy()
    m.consume_tokens(drafts)
    return m


@torch.inference_mode()
def apply_grammar_masks(logits: torch.Tensor, rows: list[int], seqs: list, drafted: list[list[int]]) -> None:
    """Set the logits of tokens each row's sequence may not take next (after the row's drafts) to -inf, in
    place: those its matcher forbids, and a closed number's further digits (a draft never reaches one:
    Sequence.draftable)."""
    allowed = allowed_tokens([_after(s.grammar, d) for s, d in zip(seqs, drafted)], logits.shape[1])
    _without_more_digits(allowed, seqs)
    allowed = allowed.to(logits.device, non_blocking=True)
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, idx)
    sub.masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, idx, sub)


@torch.inference_mode()
def force_tokens(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """Each row in `rows` may take only its token in `tokens` (every other logit -inf), in place."""
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    kept = logits[idx, ids]
    logits[idx] = float("-inf")
    logits[idx, ids] = kept
