"""Chapter 06 exercises: the pieces of generation you write yourself.

    task 1  bpe_merge           the BPE merge loop                   pytest -m ch06_bpe_merge --impl=exercises
    task 2  top_p_filter        nucleus (top-p) filtering             pytest -m ch06_top_p --impl=exercises
    task 3  StreamDetokenizer   text from a token stream, whole       pytest -m ch06_stream_detokenizer --impl=exercises
                                characters only
    task 4  decode_step         one token through the model and its   pytest -m ch06_decode_step --impl=exercises
                                KV cache (slow: the real model)

Each stub has exactly the signature of the package's version (see REFERENCE); read that one after
you have tried.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from minillm.generation.tokenizer import Tokenizer
    from minillm.model.kv_cache import KVCache
    from minillm.model.transformer import Model

REFERENCE = {
    "bpe_merge": "minillm.generation.tokenizer.bpe_merge",
    "top_p_filter": "minillm.generation.sampling.top_p_filter",
    "StreamDetokenizer": "minillm.generation.tokenizer.StreamDetokenizer",
    "decode_step": "minillm.generation.generate.decode_step",
}

# The functions each task (pytest marker) grades: course.check(marker) runs its tests.
TASKS = {
    "ch06_bpe_merge": ["bpe_merge"],
    "ch06_top_p": ["top_p_filter"],
    "ch06_stream_detokenizer": ["StreamDetokenizer"],
    "ch06_decode_step": ["decode_step"],
}


def bpe_merge(symbols: list[str], merge_ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply ranked merges to one word: fuse the lowest-ranked adjacent pair until none is left.

    `symbols` is one pre-tokenized word, one symbol per byte (GPT-2's byte map: " world" arrives as
    ["Ġ", "w", "o", "r", "l", "d"]). `merge_ranks` maps a pair of adjacent symbols to its rank:
    rank 0 was learned first and is applied first.

    Loop:
      1. among all adjacent pairs (symbols[i], symbols[i + 1]), find the one with the lowest rank;
         pairs missing from `merge_ranks` never merge;
      2. if no pair has a rank, stop;
      3. otherwise replace every occurrence of that pair, scanning left to right, by the
         concatenated symbol ("aaa" with the merge ("a", "a") becomes ["aa", "a"]), and repeat.

    Return the final list of symbols; the tokenizer maps each to its id.
    Example: ranks {("l","o"): 0, ("lo","w"): 1, ("e","r"): 2, ("low","er"): 3} turn "lower" into
    ["lo","w","e","r"] -> ["low","e","r"] -> ["low","er"] -> ["lower"].
    """
    raise NotImplementedError("chapter 6, task 1")


def top_p_filter(logits: np.ndarray, top_p: float | np.ndarray) -> np.ndarray:
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability reaches top_p.

    `logits` has shape (..., V) - one row (V,) or a batch (B, V); `top_p` is a number, or one value
    per row with shape (...). Return a float copy of `logits` in which the dropped tokens are -inf.

    Per row:
      1. sort the tokens by probability, most likely first (softmax of the logits);
      2. walk down the sorted list; keep a token while the total probability of the tokens
         *before* it is still below top_p. So the token that crosses top_p is kept, and the most
         likely token always is (nothing comes before it);
      3. put the keep/drop decisions back in token order and set the dropped logits to -inf.

    Example: probabilities [0.1, 0.5, 0.25, 0.15] with top_p 0.7 keep tokens 1 (0.5) and 2 (0.25,
    which crosses 0.7): mass before them 0 and 0.5, before token 3 it is 0.75.
    Hint: np.argsort(-logits, axis=-1), np.cumsum, and np.put_along_axis to scatter back.
    """
    raise NotImplementedError("chapter 6, task 4")


class StreamDetokenizer:
    """Turns a stream of token ids into text pieces that never split a UTF-8 character.

    A byte-level token may end in the middle of a character: "语" is 3 bytes (E8 AF AD) and a small
    vocabulary spells it as 3 tokens. Decoding each token on its own would print garbage (U+FFFD).
    Keep a buffer of bytes instead:

      __init__(tokenizer, skip_special_tokens=False)
          remember the tokenizer; start with an empty byte buffer.
      push(token_id) -> str
          ignore the token (return "") if skip_special_tokens and token_id is in
          tokenizer.special_ids; otherwise append tokenizer.token_bytes(token_id) to the buffer,
          decode and return the longest prefix that does not end inside a character, and keep the
          rest. UTF-8: a lead byte 0xxxxxxx starts a 1-byte character, 110xxxxx a 2-byte one,
          1110xxxx 3, 11110xxx 4; continuation bytes are 10xxxxxx. Only the last lead byte of the
          buffer (at most 3 bytes from its end) can start an unfinished character.
      flush() -> str
          the stream ended: decode whatever is left (errors="replace") and empty the buffer.

    Every piece, joined, must equal tokenizer.decode(ids) (decode with errors="replace").
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        raise NotImplementedError("chapter 6, task 2")

    def push(self, token_id: int) -> str:
        raise NotImplementedError("chapter 6, task 2")

    def flush(self) -> str:
        raise NotImplementedError("chapter 6, task 2")


def decode_step(model: Model, cache: KVCache, token_id: int, position: int, slot: int = 0) -> np.ndarray:
    """One decode step of one sequence: the logits of the token after ``token_id`` -> (V,) float32.

    Inputs: ``model`` (minillm/model/transformer.py; its forward takes a flat batch - token ids
    (N,), an AttentionMetadata (minillm/model/kv_cache.py) and a cache - and returns the logits
    of the rows meta.logits_indices, (L, V)); ``cache``, whose slot ``slot`` holds the K/V of
    this sequence's first ``position`` tokens; ``token_id``, the token sampled last, which sits
    at ``position``.
    Output: (V,) float32, the next-token logits - equal to those of a full forward over all
    position + 1 tokens.
    Invariants: one forward of one new token (not the whole sequence again); afterwards the
    cache holds this token's K/V too, position + 1 tokens in all; other slots are untouched.
    Edge cases: position = 0 (nothing cached: the token attends to itself only); the last
    position the cache has room for.

    Test: .venv/bin/python -m pytest -m ch06_decode_step --impl=exercises   (against transformers)
    """
    raise NotImplementedError("chapter 6, task 3")
