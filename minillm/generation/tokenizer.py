"""Byte-level BPE, from scratch: text -> token ids -> text.

The tokenizer of GPT-2, Llama 3, Qwen and SmolLM works in four steps:

    1. special tokens   "<|im_start|>", "<|im_end|>" ... are cut out of the text first (longest
                        match wins) and map straight to their ids; BPE never sees them.
    2. pre-tokenize     a regex splits the rest into words: " world", "123" -> "1" "2" "3", "'s",
                        "\\n\\n" ... Merges never cross a word boundary.
    3. bytes -> symbols each word's UTF-8 bytes become printable characters (GPT-2's byte map:
                        the space byte is "Ġ", the newline "Ċ"), one symbol per byte, so every
                        string is representable and there is no unknown token.
    4. merge            the merge list is ranked; repeatedly fuse the adjacent pair of lowest rank
                        until no pair is in the list. The symbols left are vocabulary tokens.

Decoding is the inverse of step 3: each token maps back to its bytes, and the bytes are decoded as
UTF-8. One token can end in the middle of a character (a CJK character is 3 bytes, an emoji 4),
which is why streaming needs `StreamDetokenizer`.

A tokenizer is built from GGUF metadata (`tokenizer.ggml.*`) or from a Hugging Face
`tokenizer.json`; both describe the same four steps.
"""
from __future__ import annotations

import heapq
import json
import os
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import regex

if TYPE_CHECKING:
    from minillm.model.gguf import GGUFFile

# -----------------------------------------------------------------------------------------------
# Pre-tokenizer patterns

# GPT-2: contractions, letters with an optional leading space, numbers, punctuation runs, and
# whitespace - a run of spaces before a word leaves its last space to the word (" world").
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Qwen2 / Qwen3: contractions in any case, a word may take one leading non-letter ("_foo", "$x"),
# digits one at a time, newlines kept with the punctuation or whitespace before them.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                 r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

# Every digit on its own, as in SmolLM: applied first, then GPT-2's pattern to each piece.
SINGLE_DIGIT_PATTERN = r"\p{N}"

# tokenizer.ggml.pre -> the patterns applied in turn (each splits every piece the previous made).
PRETOKENIZERS = {
    "gpt2": (GPT2_PATTERN,),
    "gpt-2": (GPT2_PATTERN,),  # llama.cpp's spelling for GPT-2 models
    "smollm": (SINGLE_DIGIT_PATTERN, GPT2_PATTERN),
    "qwen2": (QWEN2_PATTERN,),
}

# GGUF tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


def split_isolated(pattern: regex.Pattern, text: str) -> list[str]:
    """Cut `text` at every match of `pattern`; matches and the gaps between them are all pieces."""
    pieces, last = [], 0
    for m in pattern.finditer(text):
        if m.start() > last:
            pieces.append(text[last:m.start()])
        pieces.append(m.group())
        last = m.end()
    if last < len(text):
        pieces.append(text[last:])
    return pieces


# -----------------------------------------------------------------------------------------------
# The byte <-> symbol map (GPT-2)

def bytes_to_unicode() -> dict[int, str]:
    """Map each of the 256 bytes to a printable character.

    Printable Latin-1 bytes map to themselves; the other 68 (control bytes, space, 0x7F-0xA0, 0xAD)
    map to chr(256), chr(257), ... in byte order. So the space 0x20 becomes "Ġ" (U+0120) and the
    newline 0x0A "Ċ" (U+010A): tokens are printable strings that never contain a real space.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


BYTE_TO_SYMBOL = bytes_to_unicode()
SYMBOL_TO_BYTE = {s: b for b, s in BYTE_TO_SYMBOL.items()}


def token_text_to_bytes(token: str) -> bytes:
    """The bytes a vocabulary string stands for.

    Ordinary tokens are spelled in byte symbols. A special token written with characters outside
    the byte map (a space, say) stands for its own UTF-8 text - the rule Hugging Face's byte-level
    decoder uses too.
    """
    if all(ch in SYMBOL_TO_BYTE for ch in token):
        return bytes(SYMBOL_TO_BYTE[ch] for ch in token)
    return token.encode("utf-8")


# -----------------------------------------------------------------------------------------------
# The merge loop

def bpe_merge(symbols: list[str], merge_ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply ranked merges to one word: fuse the lowest-ranked adjacent pair until none is left.

    Ties go to the leftmost pair, so every occurrence of the best pair fuses left to right (in
    "aaa" with merge ("a", "a") that gives ["aa", "a"]). Rescanning every pair after each merge
    would cost O(n^2) on an n-symbol word - 20 s for a 32k-character "word" a client can send -
    so, as the `tokenizers` library does, the candidate pairs wait in a heap ordered by
    (rank, position) and the symbols form a linked list: each merge pops one pair, fuses it, and
    pushes the two new pairs it made with its neighbours. O(n log n) in all. A popped pair whose
    symbols have changed since it was pushed is stale and skipped.
    """
    word = list(symbols)                                 # word[i]: the symbol starting at i, None once fused away
    n = len(word)
    nxt = [*range(1, n), -1]                             # linked list over the live positions
    prv = [*range(-1, n - 1)]
    heap = [(rank, i) for i in range(n - 1) if (rank := merge_ranks.get((word[i], word[i + 1]))) is not None]
    heapq.heapify(heap)
    while heap:
        rank, i = heapq.heappop(heap)
        j = nxt[i] if word[i] is not None else -1
        if j < 0 or merge_ranks.get((word[i], word[j])) != rank:   # stale: one of its symbols changed
            continue
        word[i], word[j] = word[i] + word[j], None        # fuse j into i and unlink j
        nxt[i] = nxt[j]
        if nxt[i] >= 0:
            prv[nxt[i]] = i
        for left, right in ((prv[i], i), (i, nxt[i])):
            if left >= 0 and right >= 0 and (r := merge_ranks.get((word[left], word[right]))) is not None:
                heapq.heappush(heap, (r, left))
    return [s for s in word if s is not None]


# -----------------------------------------------------------------------------------------------
# The tokenizer

class TooManyTokens(ValueError):
    """`encode(..., max_tokens=N)` stopped: the text needs more than N tokens."""

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


class Tokenizer:
    """Byte-level BPE tokenizer: `encode(text) -> ids`, `decode(ids) -> text`.

    `pretokenizer` lists the split patterns, applied in turn. `added_ids` are matched verbatim in
    the text before BPE (GGUF control and user-defined tokens, Hugging Face added tokens);
    `special_ids` (a subset) are the ones `skip_special_tokens` drops. `unk_symbol_id` stands in
    for a symbol the vocabulary lacks (None: drop it); `unk_id` is only the model's declared one.
    """

    # The word cache is bounded by what it holds, not by how many words: a client can send words
    # of any length, and remembering long ones (which rarely come back) would grow the process.
    CACHE_BYTES = 16 << 20     # about: each word's UTF-8 bytes + 8 per id + 100 for the entry
    CACHE_LONGEST_WORD = 256   # bytes; longer words are encoded each time, never cached

    def __init__(self, tokens: Sequence[str], merges: Iterable[tuple[str, str]], pretokenizer: Sequence[str],
                 added_ids: Iterable[int] = (), special_ids: Iterable[int] = (), *,
                 bos_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None,
                 unk_id: int | None = None, add_bos: bool = False, chat_template: str | None = None,
                 normalize_nfc: bool = False, ignore_merges: bool = False, unk_symbol_id: int | None = None):
        self.id_to_token = list(tokens)
        self.token_to_id = {t: i for i, t in enumerate(self.id_to_token)}
        if len(self.token_to_id) != len(self.id_to_token):
            raise ValueError("the vocabulary lists the same token string twice")
        self.vocab_size = len(self.id_to_token)
        self.merge_ranks = {tuple(pair): rank for rank, pair in enumerate(merges)}
        self.split_patterns = [regex.compile(p) for p in pretokenizer]

        self.added_ids = sorted(set(added_ids))
        self.special_ids = frozenset(special_ids)
        for i in (*self.added_ids, *self.special_ids, bos_id, eos_id, pad_id, unk_id):
            if i is not None and not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary (size {self.vocab_size})")
        self.added_token_ids = {self.id_to_token[i]: i for i in self.added_ids}
        # Longest first, so that "<|im_start|>" wins over a shorter token that is its prefix.
        added_texts = sorted(self.added_token_ids, key=len, reverse=True)
        self.added_pattern = regex.compile("|".join(regex.escape(t) for t in added_texts)) if added_texts else None

        self.bos_id, self.eos_id, self.pad_id, self.unk_id = bos_id, eos_id, pad_id, unk_id
        self.bos_token = None if bos_id is None else self.id_to_token[bos_id]
        self.eos_token = None if eos_id is None else self.id_to_token[eos_id]
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.normalize_nfc = normalize_nfc
        self.ignore_merges = ignore_merges
        self.unk_symbol_id = unk_symbol_id
        self.id_to_bytes = [token_text_to_bytes(t) for t in self.id_to_token]
        # No token stands for more characters than this: a text longer than limit x this cannot fit
        # in `limit` tokens, whatever BPE would do with it (see `encode`'s max_tokens).
        self.max_token_chars = max([len(t) for t in self.added_token_ids] + [len(b) for b in self.id_to_bytes])
        self._word_cache: dict[str, list[int]] = {}
        self._word_cache_bytes = 0

    # --- encode ---------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, *, special: bool = True,
               max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids unless `special`
        is False (then "<|im_start|>" is plain text, as any other characters).

        `add_bos` defaults to the model's own setting (`add_bos_token`). Encode a prompt rendered
        from a chat template with `add_bos=False`: the template writes any BOS itself.
        `max_tokens`: raise `TooManyTokens` as soon as the ids would exceed it - before any work
        when the text is too long for that many tokens of the longest kind, otherwise as soon as
        the count passes it (text beyond that point is never tokenized).
        """
        return self.encode_parts([(text, special)], add_bos, max_tokens=max_tokens)

    def encode_parts(self, parts: Iterable[tuple[str, bool]], add_bos: bool | None = None, *,
                     max_tokens: int | None = None) -> list[int]:
        """Token ids of the concatenated texts of `parts`, each `(text, special)`: special tokens
        are recognised only in the parts whose flag is True. Neighbouring plain text is tokenized as
        one text, so the ids equal `encode` of the whole wherever the plain parts hold no special
        token (chat prompts: the template's markup is special, the messages' contents plain)."""
        parts = list(parts)
        for text, _ in parts:
            if not isinstance(text, str):
                raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids = [self.bos_id] if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None else []
        if max_tokens is not None and (size := sum(len(text) for text, _ in parts)) > max_tokens * self.max_token_chars:
            raise TooManyTokens(f"the text is {size} characters long; no {max_tokens} tokens hold more than "
                                f"{max_tokens * self.max_token_chars} (this vocabulary's longest token is "
                                f"{self.max_token_chars} characters)", max_tokens)
        for segment in self._segments(parts):
            if isinstance(segment, int):  # a special token
                ids.append(segment)
                continue
            if self.normalize_nfc:
                segment = unicodedata.normalize("NFC", segment)
            for word in self.pretokenize(segment):
                ids.extend(self._encode_word(word))
                if max_tokens is not None and len(ids) > max_tokens:
                    raise TooManyTokens(f"the text holds more than {max_tokens} tokens", max_tokens)
        if max_tokens is not None and len(ids) > max_tokens:  # the last segment was a special token
            raise TooManyTokens(f"the text holds more than {max_tokens} tokens", max_tokens)
        return ids

    def _segments(self, parts: list[tuple[str, bool]]) -> list[str | int]:
        """Plain text runs and special token ids, in order; adjacent plain text is joined."""
        segments: list[str | int] = []
        plain: list[str] = []
        for text, special in parts:
            # An added token's text is always a match, never a gap: the pattern would have found it.
            pieces = split_isolated(self.added_pattern, text) if special and self.added_pattern else [text]
            for piece in pieces:
                if special and piece in self.added_token_ids:
                    if plain:
                        segments.append("".join(plain))
                        plain = []
                    segments.append(self.added_token_ids[piece])
                elif piece:
                    plain.append(piece)
        if plain:
            segments.append("".join(plain))
        return segments

    def pretokenize(self, text: str) -> list[str]:
        """Split text into the words BPE merges within (each pattern splits every piece in turn)."""
        pieces = [text] if text else []
        for pattern in self.split_patterns:
            pieces = [p for piece in pieces for p in split_isolated(pattern, piece)]
        return pieces

    def _encode_word(self, word: str) -> list[int]:
        ids = self._word_cache.get(word)
        if ids is None:
            symbols = "".join(BYTE_TO_SYMBOL[b] for b in word.encode("utf-8"))  # one symbol per byte
            if self.ignore_merges and symbols in self.token_to_id:  # whole word in vocab: take it as is
                ids = [self.token_to_id[symbols]]
            else:
                # A symbol outside the vocabulary (SmolLM has no token for the byte 0x04) becomes
                # unk_symbol_id, or is dropped when there is none - as llama.cpp and HF tokenizers do.
                merged = bpe_merge(list(symbols), self.merge_ranks)
                ids = [self.token_to_id.get(s, self.unk_symbol_id) for s in merged]
                ids = [i for i in ids if i is not None]
            self._remember(word, ids)
        return ids

    def _remember(self, word: str, ids: list[int]) -> None:
        """Cache a short word's ids; when the cache reaches CACHE_BYTES it starts over."""
        size = len(word.encode("utf-8"))
        if size > self.CACHE_LONGEST_WORD:
            return
        cost = size + 8 * len(ids) + 100
        if self._word_cache_bytes + cost > self.CACHE_BYTES:
            self._word_cache.clear()
            self._word_cache_bytes = 0
        self._word_cache[word] = ids
        self._word_cache_bytes += cost

    # --- decode ---------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (may be part of a UTF-8 character)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return self.id_to_bytes[token_id]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        data = b"".join(self.token_bytes(int(i)) for i in ids
                        if not (skip_special_tokens and int(i) in self.special_ids))
        return data.decode("utf-8", errors="replace")

    # --- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, gguf: str | os.PathLike | GGUFFile) -> Tokenizer:
        """From a GGUF file: a path or an open `minillm.model.gguf.GGUFFile`."""
        if isinstance(gguf, (str, os.PathLike)):
            from minillm.model.gguf import GGUFFile
            gguf = GGUFFile(gguf)
        return cls.from_gguf_metadata(gguf.metadata)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """From GGUF metadata (`tokenizer.ggml.*` keys, `tokenizer.chat_template`)."""
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model is {model!r}: only byte-level BPE ('gpt2') is supported")
        for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if key not in meta:
                raise ValueError(f"the GGUF metadata has no {key}")
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [TOKEN_NORMAL] * len(tokens))]
        if len(types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        return cls(
            tokens,
            merges=(tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]),
            pretokenizer=pretokenizer_patterns(meta.get("tokenizer.ggml.pre", "gpt2")),
            added_ids=[i for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)],
            special_ids=[i for i, t in enumerate(types) if t == TOKEN_CONTROL],
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            pad_id=meta.get("tokenizer.ggml.padding_token_id"),
            unk_id=meta.get("tokenizer.ggml.unknown_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_json(cls, path: str | os.PathLike) -> Tokenizer:
        """From a Hugging Face `tokenizer.json` (the file, or the model directory holding it).

        A `tokenizer_config.json` next to it supplies bos/eos/pad/unk, `add_bos_token` and the chat
        template (`chat_template.jinja` too, where newer models keep it).
        """
        path = Path(path)
        folder, path = (path, path / "tokenizer.json") if path.is_dir() else (path.parent, path)
        spec = json.loads(path.read_text(encoding="utf-8"))
        model = spec.get("model") or {}
        if model.get("type") != "BPE":
            raise ValueError(f"{path}: model type {model.get('type')!r} is not supported; only byte-level 'BPE'")
        if model.get("byte_fallback") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise ValueError(f"{path}: byte_fallback / subword prefixes / word suffixes are not byte-level BPE")
        if (spec.get("decoder") or {}).get("type") != "ByteLevel":
            raise ValueError(f"{path}: the decoder is {spec.get('decoder')!r}, not ByteLevel")
        normalizer = spec.get("normalizer")
        if normalizer is not None and normalizer.get("type") != "NFC":
            raise ValueError(f"{path}: normalizer {normalizer.get('type')!r} is not supported (only none or NFC)")

        by_id = {i: t for t, i in model["vocab"].items()}
        added = spec.get("added_tokens") or []
        for tok in added:
            if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word"):
                raise ValueError(f"{path}: added token {tok['content']!r} uses lstrip/rstrip/single_word, "
                                 "which this tokenizer does not implement")
            by_id[tok["id"]] = tok["content"]
        holes = sorted(set(range(max(by_id) + 1)) - set(by_id))
        if holes:
            raise ValueError(f"{path}: token ids are not contiguous (no token has id {holes[0]})")
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model.get("merges", [])]

        config = _read_tokenizer_config(folder)
        tokens = [by_id[i] for i in range(len(by_id))]
        ids = {t: i for i, t in enumerate(tokens)}
        return cls(
            tokens, merges,
            pretokenizer=_hf_pretokenizer_patterns(spec.get("pre_tokenizer"), path),
            added_ids=[t["id"] for t in added],
            special_ids=[t["id"] for t in added if t.get("special")],
            bos_id=ids.get(config.get("bos_token")), eos_id=ids.get(config.get("eos_token")),
            pad_id=ids.get(config.get("pad_token")), unk_id=ids.get(config.get("unk_token")),
            add_bos=bool(config.get("add_bos_token", False)),
            chat_template=config.get("chat_template"),
            normalize_nfc=normalizer is not None,
            ignore_merges=bool(model.get("ignore_merges", False)),
            unk_symbol_id=ids.get(model.get("unk_token")),
        )


def pretokenizer_patterns(name: str) -> tuple[str, ...]:
    """The split patterns of a named pre-tokenizer (GGUF's `tokenizer.ggml.pre`)."""
    if name not in PRETOKENIZERS:
        raise ValueError(f"unknown pre-tokenizer {name!r}; supported: {', '.join(sorted(PRETOKENIZERS))}")
    return PRETOKENIZERS[name]


def _hf_pretokenizer_patterns(spec: dict | None, path: Path) -> list[str]:
    """Translate a tokenizer.json pre_tokenizer into our list of split patterns."""
    supported = "ByteLevel (add_prefix_space false), Digits, Split (Regex, isolated), Sequence of these"
    kind = None if spec is None else spec.get("type")
    if kind == "Sequence":
        return [p for part in spec["pretokenizers"] for p in _hf_pretokenizer_patterns(part, path)]
    if kind == "ByteLevel" and not spec.get("add_prefix_space", False):
        return [GPT2_PATTERN] if spec.get("use_regex", True) else []
    if kind == "Digits":
        return [SINGLE_DIGIT_PATTERN if spec.get("individual_digits") else r"\p{N}+"]
    if (kind == "Split" and "Regex" in spec.get("pattern", {}) and spec.get("behavior") == "Isolated"
            and not spec.get("invert")):
        return [spec["pattern"]["Regex"]]
    raise ValueError(f"{path}: unknown pre-tokenizer {json.dumps(spec)}; supported: {supported}")


def _read_tokenizer_config(folder: Path) -> dict[str, Any]:
    """bos/eos/pad/unk token strings, add_bos_token and chat_template from tokenizer_config.json."""
    config_path = folder / "tokenizer_config.json"
    raw = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    config = {k: raw.get(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token", "add_bos_token")}
    for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if isinstance(config[k], dict):  # {"content": "<|im_end|>", "lstrip": false, ...}
            config[k] = config[k]["content"]
    template = raw.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = folder / "chat_template.jinja"
    config["chat_template"] = jinja_file.read_text(encoding="utf-8") if jinja_file.is_file() else template
    return config


# -----------------------------------------------------------------------------------------------
# Streaming detokenization

def complete_utf8_length(data: bytes) -> int:
    """How many leading bytes of `data` can be decoded now: all but an unfinished last character.

    A UTF-8 character starts with a lead byte that announces its length (0xxxxxxx: 1, 110xxxxx: 2,
    1110xxxx: 3, 11110xxx: 4) followed by 10xxxxxx continuation bytes. Only the last lead byte
    (at most 3 bytes back) can start a character still waiting for its continuation bytes.
    """
    for i in range(len(data) - 1, max(len(data) - 4, -1), -1):
        byte = data[i]
        if byte & 0xC0 == 0x80:  # a continuation byte: keep looking for the lead byte
            continue
        need = 4 if byte >= 0xF0 else 3 if byte >= 0xE0 else 2 if byte >= 0xC0 else 1
        return i if len(data) - i < need else len(data)
    return len(data)


class StreamDetokenizer:
    """Turns a stream of token ids into text pieces that never split a UTF-8 character.

    `push(id)` returns the newly completed text (often "", when a token ends mid-character);
    `flush()` returns what is left at the end. Concatenating every piece equals `decode(ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.pending = b""  # bytes of a character that is not complete yet

    def push(self, token_id: int) -> str:
        if self.skip_special_tokens and token_id in self.tokenizer.special_ids:
            return ""
        self.pending += self.tokenizer.token_bytes(token_id)
        cut = complete_utf8_length(self.pending)
        text, self.pending = self.pending[:cut].decode("utf-8", errors="replace"), self.pending[cut:]
        return text

    def flush(self) -> str:
        text, self.pending = self.pending.decode("utf-8", errors="replace"), b""
        return text
