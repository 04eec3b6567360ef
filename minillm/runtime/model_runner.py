"""Packs a scheduled step into one flat batch and runs the one model forward on it."""
from __future__ import annotations

import numpy as np

from minillm.model.transformer import Model
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.paged_cache import DevicePagedKVCache, PagedAttentionMetadata, PagedKVCache
from minillm.runtime.scheduler import ScheduledSeq


class ModelRunner:
    """Owns the paged KV cache; turns ``ScheduledSeq``s into token ids and their metadata."""

    def __init__(self, model: Model, block_manager: BlockManager):
        self.model = model
        self.block_manager = block_manager
        # A model resident on the GPU (minillm/model/device.py) gets its cache in device memory.
        cache_class = DevicePagedKVCache if getattr(model, "device", "cpu") == "cuda" else PagedKVCache
        self.cache = cache_class(model.config, block_manager.num_blocks, block_manager.block_size, model.ops)

    def prepare(self, scheduled: list[ScheduledSeq]) -> tuple[np.ndarray, PagedAttentionMetadata]:
        """The flat batch: each sequence's next ``num_new`` tokens, then its draft, back to back.

        Logits are asked only for sequences whose last token runs now (a decode token, or the
        final chunk of a prompt); a sequence in the middle of a chunked prefill samples nothing.
        A speculative sequence gets logits at every row from its newest token on: row j scores
        the draft's token j, and the last row is the token after the whole draft.
        """
        starts = np.array([s.seq.num_computed for s in scheduled])        # (B,) context before this step
        lens = np.array([s.num_new + len(s.draft) for s in scheduled])     # (B,)
        token_ids = np.concatenate([s.seq.token_ids[a:a + s.num_new] + s.draft
                                    for s, a in zip(scheduled, starts)])   # (N,)
        last_rows = np.cumsum(lens) - 1                                    # (B,) each sequence's last flat row
        rows = [np.arange(last - len(s.draft), last + 1)                   # 1 + k rows per sampling sequence
                for s, last in zip(scheduled, last_rows) if s.completes_prefill]
        meta = PagedAttentionMetadata.build(
            lens, starts, [self.block_manager.block_table(s.seq.seq_id) for s in scheduled],
            self.block_manager.block_size,
            logits_indices=np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))
        return token_ids, meta

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write between steps: block dst gets block src's K/V."""
        self.cache.copy_block(src, dst)

    def run(self, scheduled: list[ScheduledSeq], copies: list[tuple[int, int]]) -> np.ndarray:
        """Copy-on-write first, then one forward -> logits (rows: 1 + len(draft) per sampling sequence, V)."""
        for src, dst in copies:
            self.cache.copy_block(src, dst)
        token_ids, meta = self.prepare(scheduled)
        return self.model.forward(token_ids, meta, self.cache)
