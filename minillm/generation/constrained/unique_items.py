"""uniqueItems at run time: the items of an array that must be distinct, for scalar items.

A context-free grammar cannot compare two items, so json_grammar.py compiles a uniqueItems array
as an ordinary array whose items are texts of one byte DFA (``UniqueItems.item``: strings, numbers
without exponent, true, false, null - never arrays or objects) and marks the rule. The guide runs
this tracker beside the pushdown automaton. While such an array is open (its ``[`` read, through
the rule's state right after it) the tracker follows it byte by byte - between items, or inside
one at a state of the item DFA - and keeps the values of the finished items:

    an item ends at the "," or "]" after it (a complete scalar never goes on with those), and
        a byte that ends an item equal to a finished one is refused
    a token may not stop where the item can no longer become a fresh value (every completion
        of its text spells a value already used: "ab" when only "abc" and "abd" are allowed and
        both are used), nor right after a "," when no fresh item is left: so no dead end
    values, not texts, are compared: 1, 1.0, 1.00 and -0, 0 are equal numbers

"A completion that is fresh" is a search in the product of the item DFA and the spellings of the
used values: the spellings of a string, true, false, null are one text each, of a number the
regex of number_spellings (trailing zeros, -0; exponents are kept out of the items), so the
search is exact. Its shortest answer is also what closes an array when the token budget runs out
(budget-aware closing, grammar_guide.py). The spellings are read lazily (read_spellings: which
used values' spellings the bytes so far still begin, and where), never as one DFA of the whole
set: the set changes at every step (the mask asks "what if the item ended here", with the item
so far as one more used value), and determinizing the union of a few long strings anew took
milliseconds per token.

The grammar may read the same bytes two ways - as a uniqueItems array and as another option of an
anyOf (an array without uniqueItems, or of other items): then a duplicate, or a dead end, ends only
the parses that read a uniqueItems array, and the others go on without the tracker. (Two different
uniqueItems arrays as options are tracked as one: where one of them has no fresh value left, both
end - narrower than the schema, never wider.)

Which tokens need the tracker at all: those that hold a "," or "]" (they may end an item), those
that open an array and go on past a "," (a "[" and a "," in one token), and those whose bytes keep
the item's text a prefix of some used value's spelling (found by walking the vocabulary trie
along those spellings: a handful). Every other token leaves the item distinguishable from the used
values, so some completion is fresh.
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache

import numpy as np

from minillm.generation.constrained.automata import DEAD, DFA
from minillm.generation.constrained.dfa_ops import byte_dfa
from minillm.generation.constrained.grammar import UniqueItems
from minillm.generation.constrained.json_schema import number_spellings
from minillm.generation.constrained.regex import parse
from minillm.generation.constrained.token_index import TokenIndex

COMMA, CLOSE, OPEN, SPACE = ord(","), ord("]"), ord("["), ord(" ")


class Rejected(Exception):
    """The byte would repeat an item of a uniqueItems array."""


@dataclass(frozen=True)
class OpenArray:
    """A uniqueItems array being written: `item` is the item DFA's state, None between items."""
    rule: int                  # the pushdown rule of the array
    item: int | None
    text: bytes                # the current item's bytes so far
    used: frozenset            # value_key of each finished item


def value_key(text: bytes):
    """A scalar's JSON text as a key equal for equal JSON values (1 == 1.0 == 1e0, true != 1)."""
    value = json.loads(text)
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, bool) or value is None:
        return ("literal", value)
    return ("number", Decimal(text.decode()))


@lru_cache(maxsize=4096)
def spelling(key) -> bytes | DFA:
    """Every spelling (without exponent) of one value_key: its one JSON text for a string, true,
    false, null; for a number the byte DFA of number_spellings (trailing zeros, -0)."""
    kind, value = key
    if kind == "number":
        return byte_dfa(parse(number_spellings(value)))
    return json.dumps(value, ensure_ascii=False).encode()


# The spellings of a set of used values, read byte by byte without building their union's DFA
# (rebuilt for every set, that cost milliseconds per token with long strings). A state is the
# frozenset of (value_key, position) pairs whose spelling the bytes read so far still begin: a
# byte offset into a text, a state of a number's DFA. The empty set, NOWHERE, is DEAD.

NOWHERE = frozenset()


def start_spellings(used: frozenset) -> frozenset:
    """The state before any byte: every used value, at the start of its spelling."""
    return frozenset((key, 0) for key in used)


def read_spellings(data: bytes, state: frozenset) -> frozenset:
    """The state after `data`."""
    out = []
    for key, at in state:
        spelled = spelling(key)
        if isinstance(spelled, bytes):
            if spelled.startswith(data, at):
                out.append((key, at + len(data)))
        elif (nxt := spelled.walk(data, at)) != DEAD:
            out.append((key, nxt))
    return frozenset(out)


def spelled_out(state: frozenset) -> bool:
    """Whether the bytes read are a whole spelling of some used value."""
    for key, at in state:
        spelled = spelling(key)
        if isinstance(spelled, bytes):
            if at == len(spelled):
                return True
        elif spelled.accepting[at]:
            return True
    return False


@lru_cache(maxsize=4096)
def spelling_moves(state: frozenset) -> dict[int, frozenset]:
    """byte -> the state after it, for the bytes that keep some spelling alive."""
    out: dict[int, list] = {}
    for key, at in state:
        spelled = spelling(key)
        if isinstance(spelled, bytes):
            if at < len(spelled):
                out.setdefault(spelled[at], []).append((key, at + 1))
        else:
            row = spelled.byte_table()[at]
            for byte in np.flatnonzero(row >= 0).tolist():
                out.setdefault(byte, []).append((key, int(row[byte])))
    return {byte: frozenset(pairs) for byte, pairs in out.items()}


def fresh_completion(item: DFA, state: int, text: bytes, used: frozenset) -> bytes | None:
    """The shortest bytes that finish an item from `state` (reached by `text`) into a value not in
    `used`; None when every completion repeats one. Breadth-first in the product of the item DFA
    and the used values' spellings (NOWHERE there: the text already differs from them all)."""
    table = item.byte_table()                                                  # (S, 256)
    start = (state, read_spellings(text, start_spellings(used)))
    parents = {start: None}
    queue = deque([start])
    while queue:
        d, s = queue.popleft()
        if item.accepting[d] and not spelled_out(s):
            out = bytearray()
            node = (d, s)
            while parents[node] is not None:
                node, byte = parents[node]
                out.append(byte)
            return bytes(reversed(out))
        moves = spelling_moves(s) if s else {}
        for byte in np.flatnonzero(table[d] >= 0).tolist():
            nxt = (int(table[d, byte]), moves.get(byte, NOWHERE))
            if nxt not in parents:
                parents[nxt] = ((d, s), byte)
                queue.append(nxt)
    return None


def distinct_values(item: DFA, count: int) -> bool:
    """Whether the item language holds at least `count` distinct values."""
    return len(more_values(item, frozenset(), count)) >= count


def more_values(item: DFA, known: frozenset, count: int) -> frozenset:
    """`known` (value_keys of items) grown by fresh items until it holds `count` values, or all the
    item language has."""
    while len(known) < count:
        found = fresh_completion(item, 0, b"", known)
        if found is None:
            break
        known = known | {value_key(found)}
    return known


class Vocabulary:
    """What the masks need of a tokenizer: each token's bytes, their trie, which tokens hold the
    bytes that can end an item, and per item DFA the token index (the tokens that stay inside an
    item from each of its states)."""

    def __init__(self, tokenizer, token_bytes: list[bytes], trie, specs: dict[int, UniqueItems]):
        self.token_bytes, self.trie, self.eos_id = token_bytes, trie, tokenizer.eos_id
        holds = lambda *bs: np.array([all(b in data for b in bs) for data in token_bytes], dtype=bool)   # (V,)
        self.ending = holds(COMMA) | holds(CLOSE)   # may end an item
        self.opening = np.array([OPEN in data and COMMA in data[data.index(OPEN):] for data in token_bytes],
                                dtype=bool)        # may open an array and end an item in it
        self.items = {r: TokenIndex(spec.item, tokenizer) for r, spec in specs.items()}
        self._leaving: dict[tuple[int, int], np.ndarray] = {}

    def leaving(self, rule: int, state: int) -> np.ndarray:
        """(V,) bool: the tokens that leave an item of `rule` from its DFA state `state` (those the
        item's token index does not allow there); kept per state, a lookup per mask."""
        if (rule, state) not in self._leaving:
            leaves = np.ones(len(self.token_bytes), dtype=bool)
            leaves[self.items[rule].allowed(state)] = False
            self._leaving[(rule, state)] = leaves
        return self._leaving[(rule, state)]


class Uniqueness:
    """The uniqueItems arrays of one pushdown automaton (``pushdown.unique``), read byte by byte."""

    def __init__(self, pushdown):
        self.pushdown = pushdown
        self.specs: dict[int, UniqueItems] = pushdown.unique
        self.tables = {r: spec.item.byte_table() for r, spec in self.specs.items()}        # each (S, 256)
        # the state right after "[" in each marked rule: a configuration there has just opened it
        self.entries = {int(pushdown.table[pushdown.rule_start[r], OPEN]): r for r in self.specs}
        ends = np.append(pushdown.rule_start[1:], len(pushdown.table))
        self.bounds = {r: (int(pushdown.rule_start[r]), int(ends[r])) for r in self.specs}   # rule -> its states
        self.values: dict[int, tuple[frozenset, bool]] = {}   # rule -> item values found so far, all? (_holds)

    def fullmatch(self, data: bytes) -> bool:
        """The pushdown's fullmatch, with the items of every uniqueItems array distinct."""
        try:
            configs, _ = self.walk(None, {(self.pushdown.start, ())}, data)
        except Rejected:
            return False
        return self.pushdown.can_end(configs)

    # ---- reading -----------------------------------------------------------------------------

    def step(self, state: OpenArray | None, configs, byte: int) -> OpenArray | None:
        """The tracker after `byte` (`configs`: the pushdown's configurations after it). Raises
        Rejected when the byte ends an item equal to a finished one."""
        if state is not None:
            state = self._step_open(state, byte)
        if state is None and byte == OPEN:
            for g, _ in configs:
                if g in self.entries:
                    return OpenArray(self.entries[g], None, b"", frozenset())
        return state

    def _step_open(self, state: OpenArray, byte: int) -> OpenArray | None:
        table = self.tables[state.rule]
        if state.item is None:
            if byte == SPACE:
                return state
            if byte == CLOSE:
                return None
            nxt = int(table[0, byte])   # DEAD: not this array's text
            return None if nxt == DEAD else OpenArray(state.rule, nxt, bytes([byte]), state.used)
        nxt = int(table[state.item, byte])
        if nxt != DEAD:
            return OpenArray(state.rule, nxt, state.text + bytes([byte]), state.used)
        if byte not in (COMMA, CLOSE) or not self.specs[state.rule].item.accepting[state.item]:
            return None   # a byte this array cannot read: the parse that reads it is another one
        key = value_key(state.text)
        if key in state.used:
            raise Rejected(f"{state.text!r} repeats an item of a uniqueItems array")
        return None if byte == CLOSE else OpenArray(state.rule, None, b"", state.used | {key})

    def viable(self, state: OpenArray | None) -> bool:
        """Whether the array can still be finished with distinct items from here."""
        if state is None:
            return True
        if state.item is None:   # every used value is an item's: a fresh one is left if the items hold more
            return self._holds(state.rule, len(state.used) + 1)
        spelled = read_spellings(state.text, start_spellings(state.used))
        return self._fresh_left(state.rule, state.item, spelled)

    def _holds(self, rule: int, count: int) -> bool:
        """Whether the items of `rule` hold at least `count` distinct values. The values found are
        kept (and whether they are all there are), so that over a whole array the search runs
        about once per item, not once per token that could end one (a mask asks for each of them:
        "is a fresh item left after this?")."""
        known, complete = self.values.get(rule, (frozenset(), False))
        if len(known) < count and not complete:
            known = more_values(self.specs[rule].item, known, count)
            self.values[rule] = (known, len(known) < count)
        return len(known) >= count

    def _fresh_left(self, rule: int, item: int, spelled: frozenset) -> bool:
        """Whether some completion of the item from DFA state `item` is a fresh value (`spelled`:
        where the text so far stands in the used values' spellings): fresh_completion's question
        without its shortest answer. Depth-first along the used spellings only, up to the first
        byte that leaves them all: the item DFA is minimal (a state that is not DEAD can still be
        completed), so from there every completion is fresh."""
        table, accepting = self.tables[rule], self.specs[rule].item.accepting
        seen, todo = set(), [(item, spelled)]
        while todo:
            d, s = todo.pop()
            if not s or (accepting[d] and not spelled_out(s)):
                return True
            moves = spelling_moves(s)
            live = np.flatnonzero(table[d] >= 0).tolist()
            if any(byte not in moves for byte in live):
                return True
            for byte in live:
                nxt = (int(table[d, byte]), moves[byte])
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    def walk(self, state: OpenArray | None, configs, data: bytes):
        """(configurations, tracker) after `data`; Rejected as in step, and when it stops where the
        array cannot be finished - unless another parse reads the same bytes outside the array
        (an anyOf option that is an array without uniqueItems): then that parse goes on alone."""
        for byte in data:
            configs = self.pushdown.step(configs, byte)
            if not configs:
                break
            try:
                state = self.step(state, configs, byte)
            except Rejected as why:
                configs, state = self._outside(state, configs, why)
        if not self.viable(state):
            configs, state = self._outside(state, configs, Rejected(
                "every way to finish this uniqueItems array repeats an item"))
        return configs, state

    def _in_unique_array(self, config) -> bool:
        """Whether a configuration reads a uniqueItems array: at one of its states, or called from
        one. Their items are scalars, so every such parse alive at a byte opened its array at the
        same "[" and reads the same items: a duplicate for one is a duplicate for all."""
        g, stack = config
        return any(lo <= g < hi or any(lo <= r < hi for r in stack) for lo, hi in self.bounds.values())

    def _outside(self, state: OpenArray, configs, why: Rejected):
        """The configurations that read no uniqueItems array, the tracker closed - or `why`
        raised when there are none."""
        others = {c for c in configs if not self._in_unique_array(c)}
        if not others:
            raise why
        return others, None

    # ---- masks -------------------------------------------------------------------------------

    def keep(self, state: OpenArray | None, configs, ids: np.ndarray, vocabulary: Vocabulary) -> np.ndarray:
        """(K,) bool: which of the grammar's allowed `ids` the uniqueness allows."""
        keep = np.ones(len(ids), dtype=bool)
        if state is None:
            suspect = vocabulary.opening[ids]
        elif state.item is None:
            suspect = vocabulary.ending[ids] | np.isin(ids, self._prefix_tokens(state, vocabulary.trie))
        else:   # inside an item, only the tokens that leave it (or keep it a used value's prefix) matter
            suspect = (vocabulary.leaving(state.rule, state.item)[ids]
                       | np.isin(ids, self._prefix_tokens(state, vocabulary.trie)))
        suspect &= ids != vocabulary.eos_id
        # another parse beside the open array (anyOf): a byte the tracker refuses may still be its
        alone = state is not None and all(self._in_unique_array(c) for c in configs)
        for k in np.flatnonzero(suspect):
            data = vocabulary.token_bytes[ids[k]]
            try:
                if not alone or not self._tracked(state, data):
                    self.walk(state, configs, data)
            except Rejected:
                keep[k] = False
        return keep

    def _tracked(self, state: OpenArray, data: bytes) -> bool:
        """Check `data` with the tracker alone (no pushdown: the grammar has allowed the token
        already); False when the token closes the array and may open another one, which needs the
        pushdown's configurations. Raises Rejected as walk does."""
        for i, byte in enumerate(data):
            state = self._step_open(state, byte)
            if state is None:
                return OPEN not in data[i + 1:]
        if not self.viable(state):
            raise Rejected("every way to finish this uniqueItems array repeats an item")
        return True

    def _prefix_tokens(self, state: OpenArray, t) -> np.ndarray:
        """The tokens after which the current item's text is still a prefix of a used value's
        spelling (without a "," or "]"): the only others that could stop where nothing fresh is left."""
        if not state.used:
            return np.zeros(0, dtype=np.int64)
        table = self.tables[state.rule]
        start = (state.item, read_spellings(state.text, start_spellings(state.used)))
        if not start[1]:
            return np.zeros(0, dtype=np.int64)
        found, todo = [], [(0, start)]
        while todo:
            node, (d, s) = todo.pop()
            moves = spelling_moves(s)
            child = node + 1
            while child < t.subtree_end[node]:
                byte = int(t.byte[child])
                if d is None and byte == SPACE:
                    nxt = (None, s)
                elif byte in moves and (nd := int(table[0 if d is None else d, byte])) != DEAD:
                    nxt = (nd, moves[byte])
                else:
                    nxt = None
                if nxt is not None:
                    found.extend(t.token_ids[t.token_starts[child]:t.token_starts[child + 1]].tolist())
                    todo.append((child, nxt))
                child = int(t.subtree_end[child])
        return np.unique(np.array(found, dtype=np.int64))

    # ---- closing -------------------------------------------------------------------------------

    def closing_text(self, state: OpenArray | None, configs) -> bytes:
        """One short text that completes the whole output with distinct items: the pushdown's
        shortest closing, except that each open uniqueItems array is finished with fresh values
        (its current item, then items up to its minItems, then "]")."""
        p, out = self.pushdown, bytearray()
        while True:
            if state is not None:
                data = self._finish_array(state)
            else:
                cheapest = min(p.reading(configs), key=p.closing_cost)
                if p.closing_cost(cheapest) == 0:
                    return bytes(out)
                data, configs = p.closing_text(cheapest), {cheapest}   # its path alone: the others cost more
            for byte in data:   # stop where a uniqueItems array opens: it is finished by its own rule
                configs = p.step(configs, byte)
                opened = state is None
                state = self.step(state, configs, byte)
                out.append(byte)
                if opened and state is not None:
                    break

    def _finish_array(self, state: OpenArray) -> bytes:
        spec = self.specs[state.rule]
        out, used = bytearray(), state.used
        if state.item is not None or used:   # an item is under way, or one must follow the ","
            tail = fresh_completion(spec.item, 0 if state.item is None else state.item, state.text, used)
            out += tail
            used = used | {value_key(state.text + tail)}
        while len(used) < spec.min_items:
            item = fresh_completion(spec.item, 0, b"", used)
            out += (b"," if used else b"") + item
            used = used | {value_key(item)}
        return bytes(out + b"]")
