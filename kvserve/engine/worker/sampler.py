"""Batched token sampler: logits [B, V] -> one token per row (+ optional logprobs).

Per step the engine builds one `SamplingMetadata` (per-row tensors plus the flags that let the
common cases skip work: all greedy, no penalties, no top_k/top_p, ...), then calls
`Sampler()(logits, metadata)` and `.tolist()` on the result (one host transfer).  The order of
operations follows vLLM (v1):

  1. logprobs, if any row asks: log_softmax of the *raw* logits (before min_tokens, penalties,
     temperature and truncation), as vLLM and the OpenAI API report them;
  2. min_tokens: every eos id and every stop_token_id is banned (-inf) while a row has fewer than
     `min_tokens` outputs.  `ignore_eos` changes nothing in the sampler (it is a stop-check
     concern), so eos is banned under min_tokens even with ignore_eos (vLLM would leave it);
  3. penalties: repetition (HF: over prompt + output tokens, positive logits divided, negative
     ones multiplied), then frequency and presence (OpenAI: over output tokens only,
     logit -= frequency * count + presence * (count > 0));
  4. greedy rows (temperature < 1e-5, or top_k == 1) take the argmax (first maximum) of the
     penalised logits;
  5. the other rows: temperature, min_p, top_k, top_p (top_p renormalised over the top_k set and
     after min_p), then one random draw per row.

Truncation is by threshold: a row keeps every token whose probability is >= the cut-off one, so
tokens tied with the last kept token are kept too (as vLLM and HF do for top_k).  top_p keeps the
smallest most-likely-first prefix whose mass reaches top_p (a token is kept when the mass before
it is < top_p); the most likely token is always kept.

Randomness: unseeded rows draw from torch's default generator in one batched call; a seeded row
draws only from its own `torch.Generator`, which the engine creates once per sequence
(`make_generator(seed, fork_index)`) and passes every step, so a seeded row gets the same tokens
whatever else shares the batch.  Two draw methods, same distribution:

  * "race" (exponential race): argmax(probs / Exp(1) noise) -- the vLLM method, one noise value
    per vocabulary entry; the default on accelerators;
  * "inverse_cdf": one uniform per row, searched in the row's cumulative weights (two levels:
    block sums, then the chosen block) -- the default on CPU, where B x V exponential noise
    costs several times the rest of the step.

A Sampler keeps [B, V] scratch tensors between steps; use one per engine thread.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence as Seq

import torch

from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler_output import TokenLogprobs

__all__ = ["SamplingMetadata", "Sampler", "SamplerOutput", "TokenLogprobs", "make_generator"]

_NEG_INF = float("-inf")
# First top-k tried when a row's top_p nucleus must be found without a full sort; grown 16x per
# stage for the rows whose nucleus did not fit, up to a full sort.
_TOP_P_FIRST_K = 256
_TOP_P_GROWTH = 16
_BLOCK = 1024  # block size of the two-level row argmax and inverse-CDF search


def make_generator(seed: int, fork_index: int = 0, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-sequence generator for a seeded request (fork i of an n > 1 request uses seed + i)."""
    g = torch.Generator(device=device)
    g.manual_seed((int(seed) + int(fork_index)) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def _flat_rows(rows: Seq[Iterable[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Ragged token lists -> (row index, token id) flat int64 tensors; None when all are empty."""
    lengths = [len(r) for r in rows]  # type: ignore[arg-type]
    total = sum(lengths)
    if total == 0:
        return None
    tokens = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))
    return row_idx.to(device, non_blocking=True), tokens.to(device, non_blocking=True)


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step, as per-row tensors plus skip flags.

    "Random rows" are the non-greedy rows; the sampling-side tensors (temperature, min_p, top_k,
    top_p, generators) are indexed in random-row space (position among the random rows).
    """

    batch_size: int
    device: torch.device
    all_greedy: bool
    all_random: bool
    greedy_rows: torch.Tensor | None  # [G] int64 batch rows decoded greedily; None when all_greedy or all_random
    random_rows: torch.Tensor | None  # [R] int64 batch rows sampled randomly; None when all_random
    # --- random rows ---
    temperature: float | torch.Tensor | None  # scalar when all random rows agree; None when all 1.0
    min_p: torch.Tensor | None  # [R] float32; None when no row uses min_p
    no_top_p_k: bool
    filter_rows: torch.Tensor | None  # [F] random-row indices using top_k/top_p; None = all R
    top_k: torch.Tensor | None  # [F] int64, 0 = off
    top_p: torch.Tensor | None  # [F] float32, 1.0 = off
    top_k_values: list[int]  # the same, as Python lists (the stage plan needs no device sync)
    top_p_values: list[float]
    seeded: list[tuple[int, torch.Generator]]  # (random-row index, the row's generator)
    unseeded_rows: torch.Tensor | None  # [U] random-row indices drawing from the default generator; None = all
    # --- penalties (batch space) ---
    no_penalties: bool
    repetition_penalty: torch.Tensor | None  # [B] float32 (1.0 = off); None when no row uses it
    frequency_penalty: torch.Tensor | None  # [B] float32 (0.0 = off); None when no row uses it
    presence_penalty: torch.Tensor | None  # [B]
    output_tokens: tuple[torch.Tensor, torch.Tensor] | None  # (batch row, token id) flat, penalised rows only
    prompt_tokens: tuple[torch.Tensor, torch.Tensor] | None  # same, rows with repetition_penalty only
    # --- min_tokens (batch space) ---
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row, token id) pairs set to -inf
    # --- logprobs (batch space) ---
    max_num_logprobs: int | None  # None: no row wants logprobs
    logprob_rows: torch.Tensor | None  # [L] rows wanting logprobs; None = all B (when max_num_logprobs set)
    logprob_row_list: list[int] = field(default_factory=list)
    num_logprobs: list[int] = field(default_factory=list)  # per logprob row

    @classmethod
    def build(
        cls,
        params: Seq[SamplingParams],
        output_token_ids: Seq[Seq[int]],
        prompt_token_ids: Seq[Seq[int]],
        generators: Seq[torch.Generator | None] | None = None,
        eos_token_ids: Iterable[int] | Seq[Iterable[int]] = (),
        num_output_tokens: Seq[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> "SamplingMetadata":
        """Build once per step. `eos_token_ids` is one shared set or one set per row;
        `num_output_tokens` defaults to len(output_token_ids[i])."""
        device = torch.device(device)
        B = len(params)
        if generators is None:
            generators = [None] * B
        if len(output_token_ids) != B or len(prompt_token_ids) != B or len(generators) != B:
            raise ValueError("params, output_token_ids, prompt_token_ids and generators must have equal lengths")
        eos_shared, eos_rows = _eos_sets(eos_token_ids, B)
        if num_output_tokens is None:
            num_output_tokens = [len(o) for o in output_token_ids]

        rand, split = _row_split_fields(params, device)
        return cls(
            batch_size=B, device=device, **split,
            **_truncation_fields([params[i] for i in rand], device),
            **_draw_fields(rand, generators, device),
            **_penalty_fields(params, output_token_ids, prompt_token_ids, device),
            banned=_banned(params, num_output_tokens, eos_shared, eos_rows, device),
            **_logprob_fields(params, device),
        )

    @classmethod
    def from_sequences(cls, seqs: Seq, generators: Seq[torch.Generator | None] | None = None,
                       eos_token_ids: Iterable[int] | Seq[Iterable[int]] = (),
                       device: torch.device | str = "cpu") -> "SamplingMetadata":
        """Convenience: build from `kvserve.engine.request.Sequence` objects."""
        return cls.build([s.sampling for s in seqs], [s.output_token_ids for s in seqs],
                         [s.prompt_token_ids for s in seqs], generators, eos_token_ids, None, device)


# ---- the parts of SamplingMetadata.build, one concern each; each returns its fields by name ----
def _tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _eos_sets(eos_token_ids: Iterable[int] | Seq[Iterable[int]],
              B: int) -> tuple[set[int] | None, list[set[int]] | None]:
    """(one shared eos set, None) or (None, one set per row)."""
    if isinstance(eos_token_ids, (set, frozenset)) or not eos_token_ids or isinstance(
            next(iter(eos_token_ids)), int):
        return set(eos_token_ids), None  # type: ignore[arg-type]
    eos_rows = [set(e) for e in eos_token_ids]  # type: ignore[union-attr]
    if len(eos_rows) != B:
        raise ValueError("eos_token_ids per row must have one entry per row")
    return None, eos_rows


def _row_split_fields(params: Seq[SamplingParams], device: torch.device) -> tuple[list[int], dict]:
    """The greedy / random split (greedy: temperature ~0 or top_k == 1): the random rows' batch indices, and the
    fields that name both sets."""
    greedy = [p.greedy or p.top_k == 1 for p in params]
    rand = [i for i in range(len(params)) if not greedy[i]]
    all_greedy, all_random = not rand, len(rand) == len(params)
    return rand, dict(
        all_greedy=all_greedy, all_random=all_random,
        greedy_rows=None if all_random or all_greedy else _tensor([i for i, g in enumerate(greedy) if g], torch.int64,
                                                                  device),
        random_rows=None if all_random else _tensor(rand, torch.int64, device))


def _truncation_fields(rp: Seq[SamplingParams], device: torch.device) -> dict:
    """temperature, min_p, top_k and top_p of the random rows `rp` (random-row space), each None where no row
    needs it, so the sampler can skip the step."""
    temps = [p.temperature for p in rp]
    if not temps or all(x == 1.0 for x in temps):
        temperature: float | torch.Tensor | None = None
    elif all(x == temps[0] for x in temps):
        temperature = float(temps[0])
    else:
        temperature = _tensor(temps, torch.float32, device)

    min_p = _tensor([p.min_p for p in rp], torch.float32, device) if any(p.min_p > 0 for p in rp) else None

    frows = [j for j, p in enumerate(rp) if p.top_p < 1.0 or p.top_k > 0]
    top_k = top_p = filter_rows = None
    top_k_values: list[int] = []
    top_p_values: list[float] = []
    if frows:
        fp = [rp[j] for j in frows]
        top_k = _tensor([p.top_k for p in fp], torch.int64, device)
        top_p = _tensor([p.top_p for p in fp], torch.float32, device)
        top_k_values = [p.top_k for p in fp]
        top_p_values = [p.top_p for p in fp]
        filter_rows = None if len(frows) == len(rp) else _tensor(frows, torch.int64, device)
    return dict(temperature=temperature, min_p=min_p, no_top_p_k=not frows, filter_rows=filter_rows, top_k=top_k,
                top_p=top_p, top_k_values=top_k_values, top_p_values=top_p_values)


def _draw_fields(rand: Seq[int], generators: Seq[torch.Generator | None], device: torch.device) -> dict:
    """Which random rows draw from their own generator (seeded) and which from torch's default one."""
    seeded = [(j, generators[i]) for j, i in enumerate(rand) if generators[i] is not None]
    unseeded = [j for j, i in enumerate(rand) if generators[i] is None]
    unseeded_rows = None if len(unseeded) == len(rand) else _tensor(unseeded, torch.int64, device)
    return dict(seeded=seeded, unseeded_rows=unseeded_rows)


def _penalty_fields(params: Seq[SamplingParams], output_token_ids: Seq[Seq[int]], prompt_token_ids: Seq[Seq[int]],
                    device: torch.device) -> dict:
    """Repetition, frequency and presence penalties (batch space) and the token lists they count, only for the
    rows that use them."""
    B = len(params)
    use_rep = [p.repetition_penalty != 1.0 for p in params]
    use_fp = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    no_penalties = not any(use_rep) and not any(use_fp)
    rep = freq = pres = out_tok = prompt_tok = None
    if not no_penalties:
        if any(use_rep):
            rep = _tensor([p.repetition_penalty for p in params], torch.float32, device)
            prompt_tok = _flat_rows([prompt_token_ids[i] if use_rep[i] else () for i in range(B)], device)
        if any(p.frequency_penalty != 0.0 for p in params):
            freq = _tensor([p.frequency_penalty for p in params], torch.float32, device)
        if any(p.presence_penalty != 0.0 for p in params):
            pres = _tensor([p.presence_penalty for p in params], torch.float32, device)
        out_tok = _flat_rows([output_token_ids[i] if use_rep[i] or use_fp[i] else () for i in range(B)], device)
    return dict(no_penalties=no_penalties, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                output_tokens=out_tok, prompt_tokens=prompt_tok)


def _banned(params: Seq[SamplingParams], num_output_tokens: Seq[int], eos_shared: set[int] | None,
            eos_rows: list[set[int]] | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """min_tokens: (row, token id) pairs banned while a row has fewer outputs than its min_tokens (its eos ids
    and stop_token_ids)."""
    ban_rows: list[int] = []
    ban_toks: list[int] = []
    for i, p in enumerate(params):
        if p.min_tokens and num_output_tokens[i] < p.min_tokens:
            ids = set(eos_shared if eos_rows is None else eos_rows[i])
            ids.update(p.stop_token_ids)
            ban_rows.extend([i] * len(ids))
            ban_toks.extend(sorted(ids))
    return (_tensor(ban_rows, torch.int64, device), _tensor(ban_toks, torch.int64, device)) if ban_rows else None


def _logprob_fields(params: Seq[SamplingParams], device: torch.device) -> dict:
    """The rows that want logprobs, and how many each."""
    lrows = [i for i, p in enumerate(params) if p.logprobs is not None]
    num_lp = [params[i].logprobs for i in lrows]
    return dict(max_num_logprobs=max(num_lp) if lrows else None,  # type: ignore[type-var]
                logprob_rows=None if len(lrows) in (0, len(params)) else _tensor(lrows, torch.int64, device),
                logprob_row_list=lrows, num_logprobs=num_lp)


class SamplerOutput:
    """`token_ids` stays on the device; `tolist()` / `logprobs` do one host transfer, shared."""

    def __init__(self, token_ids: torch.Tensor, metadata: SamplingMetadata,
                 lp_sampled: torch.Tensor | None = None, lp_rank: torch.Tensor | None = None,
                 lp_top_ids: torch.Tensor | None = None, lp_top_vals: torch.Tensor | None = None):
        self.token_ids = token_ids  # [B] int64
        self._md = metadata
        self._lp = (lp_sampled, lp_rank, lp_top_ids, lp_top_vals)
        self._host: tuple[list[int], list[TokenLogprobs | None] | None] | None = None

    def _to_host(self) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        if self._host is None:
            md = self._md
            sampled, rank, top_ids, top_vals = self._lp
            if sampled is None:
                self._host = (self.token_ids.tolist(), None)
            else:
                B, L = self.token_ids.shape[0], sampled.shape[0]
                K = top_ids.shape[1] if top_ids is not None else 0
                parts = [self.token_ids.double(), sampled.double(), rank.double()]
                if K:
                    parts += [top_ids.double().flatten(), top_vals.double().flatten()]
                flat = torch.cat(parts).tolist()  # the single device -> host copy
                ids = [int(x) for x in flat[:B]]
                lp_vals, ranks = flat[B:B + L], flat[B + L:B + 2 * L]
                off = B + 2 * L
                tids, tvals = flat[off:off + L * K], flat[off + L * K:]
                out: list[TokenLogprobs | None] = [None] * B
                for j, (row, n) in enumerate(zip(md.logprob_row_list, md.num_logprobs)):
                    # a token the row cannot take (a grammar's mask, a min_tokens ban) is no top candidate
                    top = [(int(tids[j * K + c]), tvals[j * K + c]) for c in range(n) if tvals[j * K + c] > _NEG_INF]
                    out[row] = TokenLogprobs(ids[row], lp_vals[j], int(ranks[j]), top)
                self._host = (ids, out)
        return self._host

    def tolist(self) -> list[int]:
        return self._to_host()[0]

    @property
    def logprobs(self) -> list[TokenLogprobs | None] | None:
        """Per row: TokenLogprobs, or None for rows that did not ask; None when no row asked."""
        return self._to_host()[1]


class Sampler:
    """Batched sampler; see the module docstring for semantics. Never modifies `logits`.

    The random rows work on w = exp((x - max) / T) = p / p_max, so that min_p, top_k and top_p are
    all cut-offs on one tensor (min_p: w >= min_p) and the draw needs no second exp.
    """

    METHODS = ("auto", "race", "inverse_cdf")

    def __init__(self, method: str = "auto"):
        if method not in self.METHODS:
            raise ValueError(f"method must be one of {self.METHODS}, got {method!r}")
        self.method = method
        # [B, V] scratch tensors reused across steps: on CPU a fresh tensor this size costs more
        # in page faults than the arithmetic done in it.  One sampler per engine thread.
        self._ws: dict[str, torch.Tensor] = {}

    def _buf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        b = self._ws.get(name)
        if b is None or b.numel() < n or b.dtype != dtype or b.device != device:
            b = self._ws[name] = torch.empty(n, dtype=dtype, device=device)
        return b[:n].view(shape)

    def _rows(self, name: str, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """x[rows] into scratch (index_select with out=: no allocation, no page faults)."""
        return torch.index_select(x, 0, rows, out=self._buf(name, (rows.numel(), x.shape[1]), x.dtype, x.device))

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, metadata)

    # Always in inference mode, whatever the caller's: the scratch tensors are made by the first call that
    # needs them and reused by later ones, and one made in inference mode (an interjection samples inside the
    # suspended step's forward, which runs in inference mode) cannot be written outside it.
    @torch.inference_mode()
    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != md.batch_size:
            raise ValueError(f"logits must be [{md.batch_size}, V], got {tuple(logits.shape)}")

        # 1. logprobs of the raw distribution.
        lp = self._raw_logprobs(logits, md) if md.max_num_logprobs is not None else None

        # 2-3. min_tokens and penalties (they change greedy picks too).
        x = logits
        if md.banned is not None or not md.no_penalties:
            x = self._process_logits(logits, md, self._buf("x", tuple(logits.shape), torch.float32, logits.device))

        # 4. greedy rows.
        if md.all_greedy:
            return self._output(_row_argmax(x), md, lp)

        # 5. random rows: w = p / p_max, truncated in place, then one draw per row.
        w = self._scaled_probs(x if md.all_random else self._rows("xr", x, md.random_rows), md)
        if md.min_p is not None:
            self._zero_below_(w, md.min_p[:, None])
        if not md.no_top_p_k:
            self._apply_top_k_top_p_(w, md)
        sampled = self._draw(w, md)
        if md.all_random:
            return self._output(sampled, md, lp)
        out = torch.empty(md.batch_size, dtype=torch.int64, device=sampled.device)
        out.index_copy_(0, md.random_rows, sampled)
        out.index_copy_(0, md.greedy_rows, _row_argmax(self._rows("xg", x, md.greedy_rows)))
        return self._output(out, md, lp)

    def process_logits(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """min_tokens bans and penalties applied to a float32 copy of `logits` (steps 2-3)."""
        return self._process_logits(logits, md, torch.empty(logits.shape, dtype=torch.float32, device=logits.device))

    def _process_logits(self, logits: torch.Tensor, md: SamplingMetadata, x: torch.Tensor) -> torch.Tensor:
        V = logits.shape[1]
        x.copy_(logits)
        if md.banned is not None:
            rows, toks = md.banned
            keep = toks < V
            x[rows[keep], toks[keep]] = _NEG_INF
        if not md.no_penalties:
            self._apply_penalties_(x, md)
        return x

    # ------------------------------------------------------------------ pieces

    def _raw_logprobs(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        rows = logits if md.logprob_rows is None else self._rows("lp", logits, md.logprob_rows)
        return torch.log_softmax(rows.float(), dim=-1)

    @staticmethod
    def _output(token_ids: torch.Tensor, md: SamplingMetadata, lp: torch.Tensor | None) -> SamplerOutput:
        if lp is None:
            return SamplerOutput(token_ids, md)
        ids = token_ids if md.logprob_rows is None else token_ids[md.logprob_rows]
        sampled = lp.gather(1, ids[:, None]).squeeze(1)
        rank = torch.count_nonzero(lp > sampled[:, None], dim=-1) + 1
        top_ids = top_vals = None
        if md.max_num_logprobs:
            top_vals, top_ids = torch.topk(lp, min(md.max_num_logprobs, lp.shape[1]), dim=-1, sorted=True)
        return SamplerOutput(token_ids, md, sampled, rank, top_ids, top_vals)

    @staticmethod
    def _apply_penalties_(x: torch.Tensor, md: SamplingMetadata) -> None:
        """Penalties in place, touching only the (row, token) entries that occur: the flat indices
        row * V + token are counted with one torch.unique, so no [B, V] count tensor is built."""
        V = x.shape[1]
        xf = x.view(-1)
        out_idx = out_cnt = None
        if md.output_tokens is not None:
            rows, toks = md.output_tokens
            out_idx, out_cnt = torch.unique(rows * V + toks, return_counts=True)
        if md.repetition_penalty is not None:
            parts = [] if out_idx is None else [out_idx]
            if md.prompt_tokens is not None:
                rows, toks = md.prompt_tokens
                parts.append(rows * V + toks)
            if parts:
                seen = torch.unique(torch.cat(parts)) if len(parts) > 1 else parts[0]
                r = md.repetition_penalty[seen // V]
                v = xf[seen]
                xf[seen] = torch.where(v > 0, v / r, v * r)
        if out_idx is not None and (md.frequency_penalty is not None or md.presence_penalty is not None):
            row = out_idx // V
            v = xf[out_idx]
            if md.frequency_penalty is not None:
                v = v - md.frequency_penalty[row] * out_cnt
            if md.presence_penalty is not None:
                v = v - md.presence_penalty[row]
            xf[out_idx] = v

    def _scaled_probs(self, xr: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """w = exp((x - max) / T): probabilities relative to the row's most likely token (scratch)."""
        w = self._buf("w", tuple(xr.shape), torch.float32, xr.device)
        if xr.dtype == torch.float32:
            torch.sub(xr, xr.amax(dim=-1, keepdim=True), out=w)
        else:
            w.copy_(xr)
            w.sub_(w.amax(dim=-1, keepdim=True))
        if md.temperature is not None:
            w.div_(md.temperature if isinstance(md.temperature, float) else md.temperature[:, None])
        return w.exp_()

    def _zero_below_(self, w: torch.Tensor, cut: torch.Tensor) -> None:
        """w[w < cut] = 0, per row. (A float 0/1 mask and a multiply: on CPU, bool masks and
        masked_fill_ run several times slower than this.)"""
        keep = self._buf("keep", tuple(w.shape), torch.float32, w.device)
        torch.ge(w, cut, out=keep)
        w.mul_(keep)

    def _apply_top_k_top_p_(self, w: torch.Tensor, md: SamplingMetadata) -> None:
        """Zero, per filter row, every weight below the row's cut-off (w = p / p_max, in place).

        The cut-off is found from the top-K candidates, K as small as the rows allow: rows with
        top_k are resolved from the top max_top_k values; a top_p-only row is resolved once the
        mass of its top K reaches top_p (the usual case for a peaked LM distribution), else the
        row moves on to a 16x larger K, ending in a full sort.  Every stage works on a batch of
        rows at once; only rows still unresolved go on.
        """
        V = w.shape[1]
        max_top_k = max((k for k in md.top_k_values if k < V), default=0)
        any_p_only = any(p < 1.0 and not 0 < k < V for k, p in zip(md.top_k_values, md.top_p_values))
        if not max_top_k and not any_p_only:
            return  # only top_k >= V: nothing to cut
        wf = w if md.filter_rows is None else self._rows("wf", w, md.filter_rows)
        F = wf.shape[0]
        top_k, top_p = md.top_k, md.top_p
        k_eff = torch.where(top_k > 0, top_k.clamp(max=V), V)
        # normaliser of the (min_p-filtered) full row, for the rows without top_k
        z_full = wf.sum(dim=-1) if any_p_only else None
        K = min(V, max(max_top_k, _TOP_P_FIRST_K if any_p_only else 0))

        cut = wf.new_zeros(F)
        rows = None  # None = all F rows still open
        while True:
            ws = wf if rows is None else self._rows("ws", wf, rows)
            if K >= V:
                vals = torch.sort(ws, dim=-1, descending=True).values
            else:
                vals = torch.topk(ws, K, dim=-1, sorted=True).values
            ke = k_eff if rows is None else k_eff[rows]
            p = top_p if rows is None else top_p[rows]
            in_k = torch.arange(K, device=ws.device)[None, :] < ke[:, None]
            e = vals * in_k
            cum = torch.cumsum(e, dim=-1)
            z = cum.gather(1, (ke.clamp(max=K) - 1)[:, None]).squeeze(1)  # mass of the top_k set
            if z_full is not None:
                zf = z_full if rows is None else z_full[rows]
                z = torch.where(ke < V, z, zf)  # rows without top_k: the whole row
            target = p * z
            keep = ((cum - e) < target[:, None]) & in_k  # the nucleus: mass before the token < top_p
            n = torch.where(p >= 1.0, ke.clamp(max=K), keep.sum(dim=-1)).clamp(min=1)
            row_cut = vals.gather(1, (n - 1)[:, None]).squeeze(1)
            resolved = None
            if K < V:
                no_cut = (p >= 1.0) & (ke >= V)  # top_k >= V and no top_p: keep everything
                row_cut.masked_fill_(no_cut, 0.0)
                resolved = (ke <= K) | (cum[:, -1] >= target) | no_cut
                if bool(resolved.all()):
                    resolved = None
            if resolved is None:
                if rows is None:
                    cut = row_cut
                else:
                    cut.index_copy_(0, rows, row_cut)
                break
            done = resolved.nonzero().squeeze(1)
            cut.index_copy_(0, done if rows is None else rows[done], row_cut[done])
            open_ = (~resolved).nonzero().squeeze(1)
            rows = open_ if rows is None else rows[open_]
            K = min(V, K * _TOP_P_GROWTH)

        self._zero_below_(wf, cut[:, None])
        if md.filter_rows is not None:
            w.index_copy_(0, md.filter_rows, wf)

    def _method(self, device: torch.device) -> str:
        if self.method == "auto":
            return "inverse_cdf" if device.type == "cpu" else "race"
        return self.method

    def skip_draws(self, generator: torch.Generator, num_tokens: int, vocab_size: int) -> None:
        """Advance a seeded row's generator past the draws of `num_tokens` sampled tokens, as `_draw` makes
        them (one uniform per token, or one exponential per vocabulary entry): a request continued after
        tokens generated elsewhere then draws what it would have drawn there."""
        method = self._method(generator.device)
        for _ in range(num_tokens):
            if method == "race":
                torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)
            else:
                torch.empty(1, device=generator.device).uniform_(generator=generator)

    def _draw(self, w: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """One token per row of the unnormalised weights `w` (consumed)."""
        method = self._method(w.device)
        R, V = w.shape
        if method == "race":  # argmax(p / Exp(1))
            q = self._buf("q", (R, V), torch.float32, w.device)
            if md.unseeded_rows is None:
                q.exponential_()
            elif md.unseeded_rows.numel():
                q.index_copy_(0, md.unseeded_rows,
                              torch.empty((md.unseeded_rows.numel(), V), device=w.device).exponential_())
            for j, g in md.seeded:
                q[j].exponential_(generator=g)
            return _row_argmax(w.div_(q.clamp_min_(torch.finfo(torch.float32).tiny)))
        # inverse CDF: the first token whose cumulative weight exceeds u * total, found in two
        # levels (block sums, then a cumsum inside the one chosen block): a row cumsum costs far
        # more than a row sum on CPU.
        if md.unseeded_rows is None or md.unseeded_rows.numel():
            u = torch.rand((R, 1), device=w.device)
        else:
            u = torch.empty((R, 1), device=w.device)
        for j, g in md.seeded:
            u[j].uniform_(generator=g)
        blk = _BLOCK if V > 4 * _BLOCK else V
        nb, tail = divmod(V, blk)
        bsum = w[:, :nb * blk].view(R, nb, blk).sum(dim=-1)
        if tail:
            bsum = torch.cat([bsum, w[:, nb * blk:].sum(dim=-1, keepdim=True)], dim=1)
        bcdf = torch.cumsum(bsum, dim=-1)
        total = bcdf[:, -1:].contiguous()
        target = u * total
        b = _search(bcdf, target, total)  # [R, 1] block index
        cols = b * blk + torch.arange(blk, device=w.device)
        inside = cols < V
        local = w.gather(1, cols.clamp_(max=V - 1)) * inside
        lcdf = torch.cumsum(local, dim=-1)
        before = torch.where(b > 0, bcdf.gather(1, (b - 1).clamp_(min=0)), 0.0)
        i = _search(lcdf, (target - before).clamp_(min=0.0), lcdf[:, -1:].contiguous())
        return (b * blk + i).squeeze(1)


def _row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) (the first maximum of each row), in two levels: block maxima, then the
    first block holding the row maximum.  Same result; several times faster than argmax on CPU for large V."""
    R, V = x.shape
    if V <= 4 * _BLOCK:
        return x.argmax(dim=-1)
    blk = _BLOCK
    nb, tail = divmod(V, blk)
    bmax = x[:, :nb * blk].view(R, nb, blk).amax(dim=-1)
    if tail:
        bmax = torch.cat([bmax, x[:, nb * blk:].amax(dim=-1, keepdim=True)], dim=1)
    b = bmax.argmax(dim=-1, keepdim=True)
    cols = b * blk + torch.arange(blk, device=x.device)
    inside = cols < V
    local = torch.where(inside, x.gather(1, cols.clamp_(max=V - 1)), float("-inf"))
    return (b * blk + local.argmax(dim=-1, keepdim=True)).squeeze(1)


def _search(cdf: torch.Tensor, target: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cdf exceeds target, never past the last positive entry
    (target can round up to the total)."""
    return torch.minimum(torch.searchsorted(cdf, target, right=True), torch.searchsorted(cdf, total))
