"""One sequence's parse under a grammar: the Guide interface (allowed, advance, forced_tokens,
accepting) over a set of pushdown configurations, with budget-aware closing.

    constraint = JsonGrammar.of(schema)          # compiled once per schema (None: any JSON object)
    guide = GrammarGuide(grammar_index(constraint, tokenizer), max_tokens=512)
    logits[mask_out(guide.allowed())] = -inf; token = sample(logits); guide.advance(token)

Budget-aware closing. The guide counts the tokens it has advanced, so it knows how many the
request has left. The automaton knows the fewest bytes that finish the structure from where the
parse stands (pushdown.py's closing lengths), and the index knows them after each allowed token
(grammar_mask.py). Two rules keep an answer stopped for length valid:

    room     a token after which even a byte-by-byte closing would not fit in the tokens left
             (minus CLOSING_MARGIN) is masked out - e.g. a long enum value or const chosen too late
    closing  once the tokens left could just hold a shortest closing text (tokenized, plus the
             margin), or when no token leaves room, the mask admits only that text's next token,
             and jump-forward writes the rest

The closing text is one shortest completion (strings end, arrays and objects close, required
properties get their shortest values; the items of a uniqueItems array stay distinct, which may
make it longer than the grammar alone says: once the grammar's estimate comes within UNIQUE_SLACK
bytes of the budget, the exact closing is walked out, and inside such an array its surcharge is
added to every token's cost). The margin keeps the closing a few tokens early: the check
counts bytes, the budget counts tokens, and a tokenized closing text may cut differently.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from minillm.generation.constrained.budget import CompileBudget
from minillm.generation.constrained.grammar_mask import GrammarIndex
from minillm.generation.constrained.json_grammar import json_object_grammar, schema_to_grammar
from minillm.generation.constrained.json_schema import SchemaError
from minillm.generation.constrained.pushdown import Pushdown
from minillm.generation.constrained.unique_items import Rejected
from minillm.generation.tokenizer import Tokenizer, complete_utf8_length

MAX_FORCED = 256     # bytes of one jump-forward
CLOSING_MARGIN = 2   # close this many tokens early (the closing text may tokenize differently later)
UNIQUE_SLACK = 32    # bytes by which distinct items may lengthen a closing beyond the grammar's estimate


class GrammarGuide:
    """A set of pushdown configurations over one grammar index, advanced token by token."""

    def __init__(self, index: GrammarIndex, max_tokens: int | None = None):
        self.index = index
        self.pushdown = index.pushdown
        self.tokenizer: Tokenizer = index.tokenizer
        self.configs = frozenset({(self.pushdown.start, ())})
        self.max_tokens = max_tokens
        self.num_tokens = 0   # advanced so far: the budget left is max_tokens - num_tokens
        self.tail = b""       # the last bytes written: does the text end inside a character?
        self.uniqueness = index.uniqueness   # None: the grammar has no uniqueItems array
        self.open_array = None               # the uniqueItems array being written (unique_items.OpenArray)
        self._closing = (None, b"")          # (configurations, open array) -> their closing text, cached

    @property
    def state(self) -> frozenset:
        return self.configs

    @property
    def accepting(self) -> bool:
        return self.pushdown.can_end(self.configs)

    def allowed(self) -> np.ndarray:
        """(K,) sorted ids of the tokens that keep the output valid (EOS where it may end)."""
        closing = self._closing_tokens()
        if closing is None:
            ids, costs = self.index.allowed_with_costs(self.configs)
            if self.uniqueness is not None:
                keep = self.uniqueness.keep(self.open_array, self.configs, ids, self.index.unique_vocabulary)
                ids, costs = ids[keep], costs[keep]
                if self.max_tokens is not None and self.open_array is not None and self._near_budget():
                    costs = costs + self._unique_surcharge()
            if self.max_tokens is None:
                return ids
            # a token after which even a byte-by-byte closing would not fit in what is left is out
            fits = costs <= self.max_tokens - self.num_tokens - 1 - CLOSING_MARGIN
            if fits.all():
                return ids
            if fits.any():
                return ids[fits]
            closing = self._closing_tokens(force=True)   # none leaves room by bytes: close now
        return np.array(closing[:1] or [self.index.eos_id], dtype=np.int64)   # []: complete, EOS is left

    def advance(self, token_id: int) -> None:
        self.num_tokens += 1
        if token_id == self.index.eos_id and self.accepting:
            return
        data = self.tokenizer.id_to_bytes[token_id]
        configs, open_array = self._walk(data, self.configs, self.open_array) if data else (set(), None)
        if not configs:
            raise ValueError(f"token {token_id} ({data!r}) breaks the grammar here")
        self.configs, self.open_array = frozenset(configs), open_array
        self.tail = (self.tail + data)[-4:]

    def forced_tokens(self) -> list[int]:
        """The tokens jump-forward may append now without a forward ([EOS] once the text is complete)."""
        closing = self._closing_tokens()
        if closing is not None:
            return closing or ([] if self.index.eos_id is None else [self.index.eos_id])
        p = self.pushdown
        if p.can_end(self.configs) and not len(p.next_bytes(self.configs)):
            return [] if self.index.eos_id is None else [self.index.eos_id]
        if complete_utf8_length(self.tail) != len(self.tail):   # mid-character: let the model finish it
            return []
        out, configs = bytearray(), self.configs
        while len(out) < MAX_FORCED and not p.can_end(configs):
            live = p.next_bytes(configs)
            if len(live) != 1:
                break
            out.append(int(live[0]))
            configs = p.step(configs, int(live[0]))
        data = bytes(out[:complete_utf8_length(bytes(out))])
        if not data:
            return []
        tokens, configs, open_array = [], self.configs, self.open_array
        for t in self.tokenizer.encode(data.decode("utf-8"), add_bos=False):
            configs, open_array = self._walk(self.tokenizer.id_to_bytes[t], configs, open_array)
            if not configs:   # e.g. text that spells a special token (or repeats a unique item): stop before it
                break
            tokens.append(t)
        return tokens

    def _walk(self, data: bytes, configs, open_array):
        """(configurations, open uniqueItems array) after `data`; no configuration when the grammar
        or the uniqueness refuses it."""
        if self.uniqueness is None:
            return self.pushdown.walk(data, configs), None
        try:
            return self.uniqueness.walk(open_array, configs, data)
        except Rejected:
            return set(), None

    # ---- budget-aware closing -----------------------------------------------------------

    def _closing_tokens(self, force: bool = False) -> list[int] | None:
        """The tokens of a shortest closing text once the budget left is down to them (or `force`);
        None before."""
        if self.max_tokens is None:
            return None
        left = self.max_tokens - self.num_tokens
        p = self.pushdown
        cost = p.closing_cost(min(p.reading(self.configs), key=p.closing_cost))
        if self.uniqueness is not None and self._near_budget():
            cost = len(self._closing_text())   # distinct items: walked out, only where it may matter
        if not force and cost + CLOSING_MARGIN < left:   # a token holds >= 1 byte: not yet
            return None
        tokens = self.tokenize_bytes(self._closing_text())
        return tokens if force or len(tokens) + CLOSING_MARGIN >= left else None

    def _closing_text(self) -> bytes:
        """One shortest text that completes the output (distinct items in uniqueItems arrays)."""
        key = (self.configs, self.open_array)
        if self._closing[0] != key:
            p = self.pushdown
            if self.uniqueness is None:
                text = p.closing_text(min(p.reading(self.configs), key=p.closing_cost))
            else:
                text = self.uniqueness.closing_text(self.open_array, self.configs)
            self._closing = (key, text)
        return self._closing[1]

    def _near_budget(self) -> bool:
        """The grammar's closing estimate is within UNIQUE_SLACK bytes of the tokens left: from here
        on the closing with distinct items is walked out (it costs a Python walk per step)."""
        p = self.pushdown
        estimate = p.closing_cost(min(p.reading(self.configs), key=p.closing_cost))
        return estimate + CLOSING_MARGIN + UNIQUE_SLACK >= self.max_tokens - self.num_tokens

    def _unique_surcharge(self) -> int:
        """How many bytes longer closing is than the grammar alone says, here: distinct items are
        longer than the shortest one repeated. Added to every token's closing cost."""
        p = self.pushdown
        return max(len(self._closing_text()) - p.closing_cost(min(p.reading(self.configs), key=p.closing_cost)), 0)

    def tokenize_bytes(self, data: bytes) -> list[int]:
        """Tokens whose bytes are `data` exactly (it may start inside a character): the tokenizer's
        own encoding where the bytes are whole characters, byte-level tokens otherwise."""
        start = len(data) - len(data.lstrip(bytes(range(0x80, 0xC0))))   # continuation bytes first
        head = [self.index.byte_token(b) for b in data[:start]]
        rest = data[start:]
        return head + (self.tokenizer.encode(rest.decode("utf-8"), add_bos=False) if rest else [])


# ---- JSON Schema constraints, compiled once per schema -------------------------------------


@dataclass(frozen=True)
class JsonGrammar:
    """A request's JSON constraint: the schema as JSON text (None: any JSON object), its keys in the
    request's order - an object's properties are written in the order its schema lists them, so
    two schemas that list them differently are two constraints."""
    schema: str | None

    @classmethod
    def of(cls, schema: dict | bool | str | None) -> JsonGrammar:
        """The constraint of `schema`, compiled now so that a bad schema fails here (SchemaError)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise SchemaError(f"the schema is not valid JSON: {e}") from None
        constraint = cls(None if schema is None else json.dumps(schema))
        json_pushdown(constraint)
        return constraint


@lru_cache(maxsize=64)
def json_pushdown(constraint: JsonGrammar) -> Pushdown:
    grammar = json_object_grammar() if constraint.schema is None else schema_to_grammar(json.loads(constraint.schema))
    return Pushdown(grammar, CompileBudget())


@lru_cache(maxsize=32)
def grammar_index(constraint: JsonGrammar, tokenizer: Tokenizer) -> GrammarIndex:
    """The masks of one constraint over one vocabulary, shared by every request that uses it."""
    return GrammarIndex(json_pushdown(constraint), tokenizer)
