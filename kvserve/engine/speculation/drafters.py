"""The drafters: where a sequence's next tokens are guessed from, without a second model.

- `NgramDrafter` (prompt lookup): the latest earlier place where the sequence's last n tokens (n from max_n
  down to min_n) occurred in its prompt and output; it proposes what followed there. Indexed incrementally, so a
  step costs the tokens appended since the last one, not a scan of the context.
- `SuffixDrafter`: the same match over a bounded cache of recent outputs of the sequence's tenant (another
  tenant's text never drafts yours): agent loops and repeated tasks continue what earlier answers said.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


class NgramIndex:
    """For each n-gram size, where each n-gram of a token list last ended (the position its continuation starts),
    extended as the list grows; a lookup finds the latest occurrence before the list's own end."""

    def __init__(self, min_n: int, max_n: int):
        self.sizes = range(max_n, min_n - 1, -1)  # longest first: the more specific match
        self._where: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # positions below this are indexed

    def extend(self, tokens: list[int]) -> None:
        """Index every continuation position up to len(tokens) - 1 (the list's end has no continuation yet)."""
        end = len(tokens) - 1
        for p in range(max(self._indexed, 1), end + 1):
            for n in self.sizes:
                if p >= n:
                    self._where[n][tuple(tokens[p - n:p])] = p
        self._indexed = max(self._indexed, end + 1)

    def continuation(self, tokens: list[int], suffix: list[int]) -> int | None:
        """Where, in the indexed list, the longest matching n-gram ending `suffix` was last followed; None."""
        for n in self.sizes:
            if len(suffix) >= n:
                p = self._where[n].get(tuple(suffix[-n:]))
                if p is not None:
                    return p
        return None


class NgramDrafter:
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's last n tokens."""

    name = "ngram"

    def __init__(self, min_n: int = 2, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[int, NgramIndex] = {}  # seq id -> its index

    def propose(self, seq_id: int, tokens: list[int], k: int) -> list[int]:
        index = self._index.get(seq_id)
        if index is None:
            index = self._index[seq_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens)
        p = index.continuation(tokens, tokens[-self.max_n:])
        return [] if p is None else tokens[p:p + k]

    def forget(self, seq_id: int) -> None:
        self._index.pop(seq_id, None)


class SuffixDrafter:
    """Matches the sequence's last tokens in its tenant's recent outputs (at most `max_tokens` tokens of them per
    tenant, oldest out first) and proposes what followed there."""

    name = "suffix"

    def __init__(self, max_tokens: int = 65536, min_n: int = 3, max_n: int = 8):
        if max_tokens <= 0 or not 1 <= min_n <= max_n:
            raise ValueError("need max_tokens > 0 and 1 <= min_n <= max_n")
        self.max_tokens, self.min_n, self.max_n = max_tokens, min_n, max_n
        self._tenants: dict[str, _TenantOutputs] = {}

    def add_output(self, tenant: str, tokens: list[int]) -> None:
        """Remember a finished output (its last max_tokens tokens at most)."""
        if len(tokens) <= self.min_n:
            return
        cache = self._tenants.setdefault(tenant, _TenantOutputs())
        cache.add(tokens[-self.max_tokens:], self.min_n, self.max_n)
        while cache.tokens > self.max_tokens:
            cache.drop_oldest(self.min_n, self.max_n)

    def propose(self, tenant: str, tokens: list[int], k: int) -> list[int]:
        cache = self._tenants.get(tenant)
        if cache is None:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(tokens) >= n:
                hit = cache.where.get(tuple(tokens[-n:]))
                if hit is not None:
                    out, p = hit
                    return cache.outputs[out][p:p + k]
        return []


@dataclass
class _TenantOutputs:
    outputs: OrderedDict[int, list[int]] = field(default_factory=OrderedDict)  # id -> tokens, oldest first
    where: dict[tuple[int, ...], tuple[int, int]] = field(default_factory=dict)  # n-gram -> (output id, next pos)
    tokens: int = 0
    next_id: int = 0

    def add(self, tokens: list[int], min_n: int, max_n: int) -> None:
        oid, self.next_id = self.next_id, self.next_id + 1
        self.outputs[oid] = tokens
        self.tokens += len(tokens)
        for key, p in _ngrams(tokens, min_n, max_n):
            self.where[key] = (oid, p)

    def drop_oldest(self, min_n: int, max_n: int) -> None:
        oid, tokens = self.outputs.popitem(last=False)
        self.tokens -= len(tokens)
        for key, _ in _ngrams(tokens, min_n, max_n):
            if self.where.get(key, (None,))[0] == oid:
                del self.where[key]


def _ngrams(tokens: list[int], min_n: int, max_n: int):
    """(n-gram, the position after it) for every n-gram of min_n..max_n tokens that something follows."""
    for p in range(min_n, len(tokens)):
        for n in range(min_n, min(max_n, p) + 1):
            yield tuple(tokens[p - n:p]), p
