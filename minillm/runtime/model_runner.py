"""Runs a scheduled step: packs it into one flat batch, runs the one model forward, chooses the tokens.

Every forward of the engine goes through here - the step's, and the early-exit drafter's - so a
tensor-parallel runner (tensor_parallel.py) that sends each forward to its ranks first sees them all.
"""
from __future__ import annotations

import numpy as np

from minillm.generation.sampling import Sampler
from minillm.generation.speculative import verify_draft
from minillm.model.kv_cache import AttentionMetadata
from minillm.model.transformer import Model
from minillm.runtime.block_manager import BlockManager
from minillm.runtime.paged_cache import DecodeMetadata, DevicePagedKVCache, PagedAttentionMetadata, PagedKVCache
from minillm.runtime.scheduler import RunnerOutput, ScheduledSeq, SchedulerOutput
from minillm.runtime.sequence import Sequence


class ModelRunner:
    """Owns the paged KV cache; turns a ``SchedulerOutput`` into token ids, metadata, logits and tokens."""

    def __init__(self, model: Model, block_manager: BlockManager, sampler: Sampler):
        self.model = model
        self.block_manager = block_manager
        self.sampler = sampler
        # A model resident on the GPU (minillm/model/device.py) gets its cache in device memory.
        cache_class = DevicePagedKVCache if getattr(model, "device", "cpu") == "cuda" else PagedKVCache
        self.cache = cache_class(model.config, block_manager.num_blocks, block_manager.block_size, model.ops)

    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """Copy-on-write, one forward over every scheduled token, then each sampling sequence's tokens."""
        token_ids, meta = self.prepare(plan.scheduled)
        return self.sample(plan.scheduled, self.forward(plan.copies, token_ids, meta))

    def prepare(self, scheduled: list[ScheduledSeq]) -> tuple[np.ndarray, PagedAttentionMetadata]:
        """The flat batch: each sequence's next tokens, then its draft, back to back.

        Logits are asked only for sequences whose newest token runs now; a sequence in the middle
        of a chunked prefill samples nothing. A speculative sequence gets logits at every row from
        its newest token on: row j scores the draft's token j, and the last row is the token after
        the whole draft. A step where every sequence runs just its newest token (most of them) gets
        the cheaper ``DecodeMetadata``.
        """
        block_tables = [self.block_manager.block_table(s.seq.seq_id) for s in scheduled]
        if all(s.num_new == 1 and s.samples and not s.draft for s in scheduled):
            token_ids = np.array([s.seq.newest_token_id for s in scheduled])  # (B,)
            contexts = [s.seq.num_computed_tokens for s in scheduled]        # (B,)
            return token_ids, DecodeMetadata.build(contexts, block_tables, self.block_manager.block_size)
        starts = np.array([s.seq.num_computed_tokens for s in scheduled])   # (B,) context before this step
        lens = np.array([s.num_new for s in scheduled])                     # (B,) draft tokens included
        token_ids = np.concatenate([s.seq.token_ids[a:a + s.num_new - len(s.draft)] + s.draft
                                    for s, a in zip(scheduled, starts)])    # (N,)
        last_rows = np.cumsum(lens) - 1                                     # (B,) each sequence's last flat row
        rows = [np.arange(last - len(s.draft), last + 1)                    # 1 + k rows per sampling sequence
                for s, last in zip(scheduled, last_rows) if s.samples]
        meta = PagedAttentionMetadata.build(
            lens, starts, block_tables, self.block_manager.block_size,
            logits_indices=np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64))
        return token_ids, meta

    def forward(self, copies: list[tuple[int, int]], token_ids: np.ndarray, meta: AttentionMetadata,
                num_layers: int | None = None) -> np.ndarray:
        """Copy-on-write first, then the model's forward (its first ``num_layers`` layers) -> logits (L, V)."""
        for src, dst in copies:
            self.cache.copy_block(src, dst)
        return self.model.forward(token_ids, meta, self.cache, num_layers=num_layers)

    def sample(self, scheduled: list[ScheduledSeq], logits: np.ndarray) -> RunnerOutput:
        """One draw per plain sampling row (n > 1 siblings draw from their parent's), a verify per draft."""
        out = RunnerOutput({}, {})
        row, rows, states, seq_ids = 0, [], [], []
        for s in scheduled:
            if not s.samples:
                continue
            if s.draft:                                       # (1 + k, V): judged row by row
                tokens, logprobs, error = verify_draft(self.sampler, logits[row:row + 1 + len(s.draft)],
                                                       s.seq.sampler_state, s.draft)
                if error is not None:
                    out.errors[s.seq.seq_id] = error
                else:
                    out.token_ids[s.seq.seq_id], out.logprobs[s.seq.seq_id] = tokens, logprobs
            else:
                for member in (s.seq, *s.forks):
                    rows.append(row)
                    states.append(member.sampler_state)
                    seq_ids.append(member.seq_id)
            row += 1 + len(s.draft)
        if rows:
            # (R, V): logits holds only the rows asked for, so without drafts or n > 1 siblings the
            # rows are all of it, in order - no copy (a (32, V) copy was ~0.3 ms a step at batch 32)
            drawn = self.sampler.sample(logits if rows == list(range(len(logits))) else logits[rows], states)
            for i, (seq_id, token, lp) in enumerate(zip(seq_ids, drawn.token_ids.tolist(), drawn.logprobs)):
                if i in drawn.errors:
                    out.errors[seq_id] = drawn.errors[i]
                else:
                    out.token_ids[seq_id], out.logprobs[seq_id] = [token], [lp]
        return out

    def draft(self, seqs: list[Sequence], num_tokens: list[int], copies: list[tuple[int, int]],
              num_layers: int) -> list[list[int]]:
        """Early exit: greedy guesses from the first ``num_layers`` layers, ``num_tokens[i]`` for sequence i.

        k forwards batched over the sequences, each running the previous guess (the first, the
        newest token); their K/V go into the lookahead slots the scheduler gave, where the verify
        forward overwrites them with the same values for those layers.
        """
        drafts: list[list[int]] = [[] for _ in seqs]
        for step in range(max(num_tokens, default=0)):
            active = [i for i, k in enumerate(num_tokens) if len(drafts[i]) < k]
            tokens = np.array([drafts[i][-1] if drafts[i] else seqs[i].newest_token_id for i in active])  # (A,)
            meta = DecodeMetadata.build([seqs[i].num_computed_tokens + step for i in active],
                                        [self.block_manager.block_table(seqs[i].seq_id) for i in active],
                                        self.block_manager.block_size)
            logits = self.forward(copies if step == 0 else [], tokens, meta, num_layers)   # (A, V)
            for i, guess in zip(active, np.argmax(logits, axis=-1).tolist()):
                drafts[i].append(guess)
        return drafts
