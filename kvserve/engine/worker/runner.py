"""ModelRunner: the engine core's executor. Owns the KV cache tensors, the sampler and the seeded
requests' generators; turns a SchedulerOutput into one forward pass and its sampled tokens (RunnerOutput).

Per step it builds the flattened inputs on the host once (token ids, positions, slot mapping,
block tables) and moves them to the device in one go; block copies (swap, copy-on-write) run as
batched index copies before the forward. A seeded sequence draws only from its own generator (made at
its first sample, past the draws of tokens it was resumed with), so its tokens do not depend on the batch.
"""
from __future__ import annotations

import time
from array import array
from collections.abc import Collection
from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig
from kvserve.engine.interjection import Interjection
from kvserve.engine.kv.groups import KVLayout
from kvserve.engine.request import Sequence
from kvserve.engine.speculation.verification import accepted_count
from kvserve.engine.worker.cuda_graphs import DecodeGraphs, GraphPlan
from kvserve.engine.worker.sampler import Sampler, SamplingMetadata, make_generator
from kvserve.engine.scheduler_output import RunnerOutput, SchedulerOutput
from kvserve.models.attention import (AttentionMetadata, PrefillChunk, cache_bytes, kv_cache_dtype, kv_cache_shape,
                                      new_kv_cache, pages)
from kvserve.engine.worker.grammar_mask import apply_grammar_masks, checked_after_sampling, force_tokens


@dataclass
class BatchItem:
    """One sequence's share of a forward pass."""

    token_ids: list[int]  # the tokens computed this step
    start: int  # position of token_ids[0]
    block_table: list[int]  # the first KV group's table
    sample: bool = True
    group_tables: list[list[int]] | None = None  # every KV group's table, where the runner's layout has several
    num_logits: int = 1  # rows of logits when sampled: the last ones (a verified draft's chunk: all of them)
    lora: str | None = None  # the LoRA adapter's key (engine/worker/adapters.py); None: the base model

    def tables(self, num_groups: int) -> list[list[int]]:
        if self.group_tables is None:
            if num_groups != 1:
                raise ValueError(f"the KV layout has {num_groups} groups: give each its table (group_tables)")
            return [self.block_table]
        if len(self.group_tables) != num_groups:
            raise ValueError(f"{len(self.group_tables)} block tables for {num_groups} KV groups")
        return self.group_tables


def _long_tensor(values, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int64 values (a list or an array('q')) as a tensor of `shape` on `device`: through an array's buffer,
    several times faster than torch.tensor on nested lists (the step's tables are tens of thousands of ids)."""
    buffer = values if isinstance(values, array) else array("q", values)
    return torch.frombuffer(buffer, dtype=torch.long).view(shape).to(device, non_blocking=True)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, config: ModelConfig, num_device_blocks: int, num_host_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device, kv_int8: bool = False,
                 kv_fp8: bool = False, eos_token_ids: Collection[int] = (), layout: KVLayout | None = None,
                 graphs: GraphPlan | None = None, pages_contiguous: bool = False):
        """`layout`: the KV groups (engine/kv/groups.py); default one group of every layer. Each of its
        `group_size` slots is one key and one value tensor of `num_device_blocks` pages, which the slot's
        layer of every group shares (a page belongs to one group at a time). `graphs`: decode-only steps replay
        captured graphs (engine/worker/cuda_graphs.py), whose padding rows get one more page, past the pool.
        `pages_contiguous`: the caches (device and host) stored blocks first (Plan.kv_pages_contiguous)."""
        self.model = model
        self.sampler = Sampler()
        self.eos_token_ids = set(eos_token_ids)  # banned while a row is under min_tokens
        self._generators: dict[int, torch.Generator] = {}  # seq_id -> a seeded sequence's generator
        self.config = config
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.layout = layout or KVLayout.for_windows([None] * config.num_layers)
        if sum(len(g.layers) for g in self.layout.groups) != config.num_layers:
            raise ValueError("the KV layout does not cover the model's layers")
        # int8 rows with their scales (kernels/kv_quant.py), e4m3 (models/fp8.py) or the model's dtype
        cache_dtype = kv_cache_dtype(dtype, kv_int8, kv_fp8)
        shape = kv_cache_shape(num_device_blocks + (graphs is not None), block_size, config.num_kv_heads,
                               config.head_dim, kv_int8)
        slots = self.layout.group_size
        self.kv_slots = [tuple(new_kv_cache(shape, cache_dtype, device, pages_contiguous) for _ in "kv")
                         for _ in range(slots)]
        placements = [self.layout.placement(layer) for layer in range(config.num_layers)]
        self.layer_groups = tuple(g for g, _ in placements)
        self.kv_caches = [self.kv_slots[slot] for _, slot in placements]  # per layer
        host_shape = kv_cache_shape(num_host_blocks, block_size, config.num_kv_heads, config.head_dim, kv_int8)
        pin = device.type == "cuda"
        self.tier = None  # the lower tier evicted pages go to (engine/kv/disk.py), set by the engine
        self.lora = self.lora_slots = self.adapters = None  # LoRA adapters' slots and source (enable_lora)
        # Held from the start (zero-filled), as the device pool: the memory preemption will need is taken while
        # the server starts, not found missing under load (and the RSS does not grow as swaps touch it).
        self.host_slots = [tuple(new_kv_cache(host_shape, cache_dtype, "cpu", pages_contiguous, pin) for _ in "kv")
                           for _ in range(slots)] if num_host_blocks else []
        self.graphs = None if graphs is None else DecodeGraphs(
            model, self.kv_caches, self.layer_groups, self.layout.num_groups, block_size,
            max_blocks=-(-graphs.max_model_len // block_size), max_batch=graphs.max_batch,
            scratch_block=num_device_blocks, device=device, capture=graphs.capture)

    # ---- block movement ------------------------------------------------------------------
    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._copy_between(pairs, self.kv_slots, self.host_slots)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._copy_between(pairs, self.host_slots, self.kv_slots)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._copy_between(pairs, self.kv_slots, self.kv_slots)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one KV group (every slot's keys and values): a lower tier's page."""
        k = self.kv_slots[0][0]
        return 2 * len(self.kv_slots) * k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()

    def offload(self, pairs: list[tuple[int, bytes]]) -> None:
        """Copy evicted (or, written through, newly cached) pages out and hand them to the lower tier under their
        keys: it writes them off this thread, whereas the blocks may be overwritten by the next forward; a full
        queue drops a page, which is only a lost cache entry."""
        if not pairs or self.tier is None:
            return
        copies = self.read_pages([b for b, _ in pairs])
        for (_, key), page in zip(pairs, copies):
            self.tier.put(key, page)

    def load(self, pairs: list[tuple[int, bytes]]) -> None:
        """Copy pages read (and verified) from the lower tier into their blocks."""
        if not pairs:
            return
        k0 = self.kv_slots[0][0]
        heads, _, bs, width = k0.shape
        flat = torch.frombuffer(bytearray(b"".join(page for _, page in pairs)), dtype=torch.uint8)
        data = flat.view(cache_bytes(k0).dtype).view(len(pairs), len(self.kv_slots), 2, heads, bs, width)
        data = data.to(k0.device)
        dst = torch.tensor([b for b, _ in pairs], dtype=torch.long, device=k0.device)
        for j, (k, v) in enumerate(self.kv_slots):
            pages(cache_bytes(k)).index_copy_(0, dst, data[:, j, 0])
            pages(cache_bytes(v)).index_copy_(0, dst, data[:, j, 1])

    def read_pages(self, blocks: list[int]) -> list[bytes]:
        """The pages of these blocks as bytes: [slot, key/value, head, token, width] each (a lower tier's page)."""
        if not blocks:
            return []
        idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
        parts = torch.stack([torch.stack([pages(k).index_select(0, idx), pages(v).index_select(0, idx)])
                             for k, v in self.kv_slots])
        # [slots, 2, pages, heads, bs, width] -> [pages, slots, 2, heads, bs, width]
        flat = parts.permute(2, 0, 1, 3, 4, 5).contiguous().cpu().view(torch.uint8).view(len(blocks), -1)
        return [bytes(row.numpy()) for row in flat]

    @staticmethod
    def _copy_between(pairs, src_caches, dst_caches) -> None:
        if not pairs:
            return
        src_dev = src_caches[0][0].device
        dst_dev = dst_caches[0][0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=src_dev)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=dst_dev)
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches):
            for s, d in ((sk, dk), (sv, dv)):  # whole pages; an e4m3 cache as bytes (no CPU index_copy_ for float8)
                moved = pages(cache_bytes(s)).index_select(0, src).to(dst_dev, non_blocking=True)
                pages(cache_bytes(d)).index_copy_(0, dst, moved)

    # ---- forward ---------------------------------------------------------------------------
    def execute(self, out: SchedulerOutput, interjection: Interjection | None = None) -> RunnerOutput:
        """Block moves, the forward pass and sampling: a token for every sequence in `out.scheduled` whose
        `sample` flag is set and for every new fork in `out.forks`. `interjection`: where the forward may
        stop between layers to let another step run (its block moves and forward run nested inside this
        one's)."""
        t0 = time.perf_counter()
        for seq_id in out.finished_seq_ids:
            self._generators.pop(seq_id, None)
        self.offload(out.blocks_to_offload)
        self.swap_out(out.blocks_to_swap_out)
        self.load(out.blocks_to_load)
        self.swap_in(out.blocks_to_swap_in)
        self.copy_blocks(out.blocks_to_copy)
        result = RunnerOutput()
        if out.scheduled:
            logits = self.forward(self.batch_items(out), interjection=interjection)
            if logits is not None:
                self._sample(out, logits, result)
        result.seconds = time.perf_counter() - t0
        return result

    @staticmethod
    def batch_items(out: SchedulerOutput) -> list[BatchItem]:
        """The forward's share of each scheduled sequence (what a tensor-parallel rank needs of the step)."""
        return [BatchItem(s.token_ids, s.start, s.block_tables[0], s.sample, s.block_tables, 1 + len(s.draft_token_ids),
                          s.seq.lora) for s in out.scheduled]

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, result: RunnerOutput) -> None:
        """One token per sampled row; a parent that forks gives its row to each of its forks too. A verified
        draft's chunk samples each of its rows as decoding would (its outputs so far being the drafts before
        the row) and keeps what engine/speculation/verification.py says. A seeded row's generator is then set
        where decoding those tokens would have left it."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        outputs: list[list[int]] = []
        drafted: list[list[int]] = []  # per row: the drafts before it (its grammar's state is after them)
        spans: list[tuple[Sequence, int, list[int]]] = []  # (sequence, its first row, its drafts)
        row = 0
        for s in (x for x in out.scheduled if x.sample):
            draft = s.draft_token_ids
            if draft:
                spans.append((s.seq, len(seqs), draft))
            for i in range(len(draft) + 1):
                rows.append(row + i)
                seqs.append(s.seq)
                outputs.append(s.seq.output_token_ids + draft[:i] if i else s.seq.output_token_ids)
                drafted.append(draft[:i])
            row += len(draft) + 1
            for child in out.forks.get(s.seq.seq_id, ()):
                rows.append(row - 1)
                seqs.append(child)
                outputs.append(child.output_token_ids)
                drafted.append([])
        if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
            logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
        generators = [self._generator(s) for s in seqs]
        # Structured outputs: masked before sampling, or checked after it (a draft row: after its drafts)
        lazy, eager = checked_after_sampling(seqs, generators)
        if eager:
            apply_grammar_masks(logits, eager, [seqs[j] for j in eager], [drafted[j] for j in eager])
        forced = [(j, s.forced_token) for j, s in enumerate(seqs) if s.forced_token is not None]
        if forced:  # a spent thinking budget: the close tag (a forced row has no drafts nor an active grammar)
            force_tokens(logits, [j for j, _ in forced], [t for _, t in forced])
        rewind = {first: g.get_state() for _, first, _ in spans if (g := generators[first]) is not None}
        md = SamplingMetadata.build([s.sampling for s in seqs], outputs, [s.prompt_token_ids for s in seqs],
                                    generators, self.eos_token_ids, device=logits.device)
        sampled = self.sampler(logits, md)
        tokens, logprobs = sampled.tolist(), sampled.logprobs
        if lazy:  # their logits are as the model gave them: the sampler never writes to them
            self._resample_disallowed(lazy, logits, seqs, outputs, drafted, tokens)
        for j, (seq, token) in enumerate(zip(seqs, tokens)):
            result.token_ids[seq.seq_id] = [token]
            if logprobs and logprobs[j] is not None:
                result.logprobs[seq.seq_id] = [logprobs[j]]
        for seq, first, draft in spans:
            n = accepted_count(tokens[first:first + len(draft) + 1], draft)
            result.token_ids[seq.seq_id] = tokens[first:first + n + 1]
            if logprobs and logprobs[first] is not None:
                result.logprobs[seq.seq_id] = logprobs[first:first + n + 1]
            g = generators[first]
            if g is not None and n < len(draft):
                g.set_state(rewind[first])
                self.sampler.skip_draws(g, n + 1, self.config.vocab_size)

    def _resample_disallowed(self, rows: list[int], logits: torch.Tensor, seqs: list[Sequence],
                             outputs: list[list[int]], drafted: list[list[int]], tokens: list[int]) -> None:
        """Rows sampled without their grammar's mask (checked_after_sampling): those whose token the grammar
        allows (after the row's drafts) keep it, the same token the masked row would have given; the others
        are masked and sampled again (the mask computed only for them)."""
        again = [j for j in rows
                 if seqs[j].grammar.validate_tokens(drafted[j] + [tokens[j]]) != len(drafted[j]) + 1]
        if not again:
            return
        sub = logits.index_select(0, torch.tensor(again, device=logits.device))
        apply_grammar_masks(sub, list(range(len(again))), [seqs[j] for j in again], [drafted[j] for j in again])
        md = SamplingMetadata.build([seqs[j].sampling for j in again], [outputs[j] for j in again],
                                    [seqs[j].prompt_token_ids for j in again], [None] * len(again),
                                    self.eos_token_ids, device=logits.device)
        for j, token in zip(again, self.sampler(sub, md).tolist()):
            tokens[j] = token

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.sampling.seed is None:
            return None
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = self._generators[seq.seq_id] = make_generator(seq.sampling.seed, seq.fork_index, self.device)
            if seq.num_output_tokens:  # resumed from tokens sampled elsewhere: go on as it would have there
                self.sampler.skip_draws(g, seq.num_output_tokens, self.config.vocab_size)
        return g

    @torch.inference_mode()
    def forward(self, items: list[BatchItem], all_logits: bool = False,
                interjection: Interjection | None = None) -> torch.Tensor | None:
        """Forward a batch of items; logits for the items with sample=True (their last num_logits rows), in
        their given order.

        all_logits=True returns logits for every token instead (items' tokens in their given order),
        for prompt logprobs and parity checks.
        """
        num_groups = self.layout.num_groups
        if self.graphs is not None and not all_logits and self._replays(items):
            hidden = self.graphs.run([it.token_ids[0] for it in items], [it.start for it in items],
                                     [it.tables(num_groups) for it in items])
            return self._logits(hidden, [i for i, it in enumerate(items) if it.sample])
        order = sorted(range(len(items)), key=lambda i: len(items[i].token_ids) != 1 or items[i].start == 0)
        lora_rows = self._lora_rows(items, order)
        if lora_rows is not None:
            interjection = None  # a nested step would take adapter slots this one holds
        input_ids, positions, sample_rows = [], [], {}
        slots: list[list[int]] = [[] for _ in range(num_groups)]
        bs = self.block_size
        num_decodes = 0
        prefills: list[tuple[int, int, int, list[list[int]]]] = []
        for i in order:
            item = items[i]
            n = len(item.token_ids)
            is_decode = n == 1 and item.start > 0
            begin = len(input_ids)
            input_ids.extend(item.token_ids)
            pos = range(item.start, item.start + n)
            positions.extend(pos)
            tables = item.tables(num_groups)
            for group_slots, table in zip(slots, tables):
                group_slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if is_decode:
                num_decodes += 1
            else:
                prefills.append((begin, n, item.start + n, [t[: (item.start + n + bs - 1) // bs] for t in tables]))
            if item.sample:
                sample_rows[i] = range(begin + n - item.num_logits, begin + n)

        dev = self.device
        dec = [items[i] for i in order[:num_decodes]]
        lens = [d.start + 1 for d in dec]
        # One host tensor (and one copy to the device) per kind of table, every group's rows in it.
        slot_t = _long_tensor([x for group in slots for x in group], (num_groups, -1), dev)  # [G, T]
        decode_t = lens_t = None
        if num_decodes:
            max_blocks = (max(lens) + bs - 1) // bs
            flat = array("q")
            dec_tables = [d.tables(num_groups) for d in dec]
            for g in range(num_groups):
                for tables in dec_tables:
                    table = tables[g][:max_blocks]
                    flat.extend(table)
                    flat.extend([0] * (max_blocks - len(table)))
            decode_t = _long_tensor(flat, (num_groups, num_decodes, max_blocks), dev)
            lens_t = torch.tensor(lens, dtype=torch.long).to(dev, non_blocking=True)
        chunk_t = [torch.tensor(t, dtype=torch.long).to(dev, non_blocking=True) for _, _, _, t in prefills]  # [G, B]
        metas = []
        for g in range(num_groups):
            meta = AttentionMetadata(slot_mapping=slot_t[g], num_decode_tokens=num_decodes, interjection=interjection)
            if num_decodes:
                meta.decode_block_tables, meta.decode_context_lens = decode_t[g], lens_t
                meta.decode_max_context, meta.decode_min_context = max(lens), min(lens)
            meta.prefills = [PrefillChunk(begin, n, ctx, table[g])
                             for (begin, n, ctx, _), table in zip(prefills, chunk_t)]
            metas.append(meta)
        meta = AttentionMetadata.of_groups(metas, self.layer_groups)
        ids = torch.tensor(input_ids, dtype=torch.long).to(dev, non_blocking=True)
        pos_t = torch.tensor(positions, dtype=torch.long).to(dev, non_blocking=True)
        if self.lora is not None:
            self.lora.set_batch(lora_rows)
            try:
                hidden = self.model(ids, pos_t, self.kv_caches, meta)
            finally:
                self.lora.set_batch(None)
        else:
            hidden = self.model(ids, pos_t, self.kv_caches, meta)
        if all_logits:
            starts, offset = {}, 0
            for i in order:
                starts[i] = offset
                offset += len(items[i].token_ids)
            rows = torch.cat([torch.arange(starts[i], starts[i] + len(items[i].token_ids)) for i in range(len(items))])
            return self.model.compute_logits(hidden.index_select(0, rows.to(dev)))
        return self._logits(hidden, [r for i in range(len(items)) if items[i].sample for r in sample_rows[i]])

    def enable_lora(self, adapters, max_loras: int, max_rank: int) -> None:
        """Serve LoRA adapters: `max_loras` slots on the device (models/lora.LoRAWeights), filled from `adapters`
        (engine/worker/adapters.Adapters) as steps need them."""
        from kvserve.engine.lora import SlotTable
        from kvserve.models.lora import LoRAWeights

        self.lora = LoRAWeights(self.model, max_loras, max_rank)
        self.lora_slots = SlotTable(max_loras)
        self.adapters = adapters

    def _lora_rows(self, items: list[BatchItem], order: list[int]) -> torch.Tensor | None:
        """Each token's adapter slot in the flattened batch (-1: the base model), the step's adapters put in their
        slots first; None where no row has an adapter."""
        if self.lora is None or all(it.lora is None for it in items):
            return None
        slots, loads = self.lora_slots.assign([it.lora for it in items if it.lora is not None])
        for slot, key in loads:
            self.lora.load(slot, self.adapters.get(key))
        rows = array("q")
        for i in order:
            item = items[i]
            rows.extend([-1 if item.lora is None else slots[item.lora]] * len(item.token_ids))
        return _long_tensor(rows, (-1,), self.device)

    def _replays(self, items: list[BatchItem]) -> bool:
        """A decode-only step (one token of a started sequence each, no drafts) that a captured graph holds. Its
        interjection, if any, is not offered: a decode step is over before one would pay. Adapters' rows run
        eagerly."""
        return (bool(items) and all(len(it.token_ids) == 1 and it.start > 0 and it.num_logits == 1 and it.lora is None
                                    for it in items)
                and self.graphs.takes(len(items), max(it.start for it in items) + 1))

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """Logits of the hidden states' `rows`, in their order; None for none."""
        if not rows:
            return None
        if rows != list(range(hidden.shape[0])):
            hidden = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=hidden.device))
        return self.model.compute_logits(hidden)
