"""One sequence's walk through a token index: what it may sample next, and what it must write next.

    pattern = guided_pattern(json_schema=schema)      # SamplingParams does this when it is made
    guide = Guide(token_index(pattern, tokenizer))
    logits[mask_out(guide.allowed())] = -inf; token = sample(logits); guide.advance(token)
    guide.forced_tokens()   # jump-forward: tokens the pattern leaves no choice about

Jump-forward (SGLang's compressed FSM): when the DFA admits a single continuation for several
characters (``{"name": "`` at the start of an object), those characters are tokenized and
appended without asking the model, and the engine runs them through the next forward as one
chunk. The tokens are the tokenizer's encoding of the forced text on its own, which may cut it
differently from how the model would have; the text is the same either way.
"""
from __future__ import annotations

import numpy as np

from minillm.generation.constrained.automata import DEAD
from minillm.generation.constrained.json_schema import json_object_regex, schema_to_regex
from minillm.generation.constrained.regex import escape, parse
from minillm.generation.constrained.token_index import TokenIndex, token_index
from minillm.generation.tokenizer import Tokenizer, complete_utf8_length


def guided_pattern(regex: str | None = None, json_schema: dict | str | None = None,
                   choice: list[str] | None = None, json_object: bool = False) -> str | None:
    """The one regex a request's constraint stands for (None: unconstrained). Raises ValueError
    (RegexError, SchemaError) naming what is not supported."""
    given = [name for name, v in (("guided_regex", regex), ("guided_json", json_schema), ("guided_choice", choice))
             if v is not None] + (["json_object"] if json_object else [])
    if len(given) > 1:
        raise ValueError(f"only one constraint per request; got {', '.join(given)}")
    if regex is not None:
        parse(regex)   # refuse a bad pattern now, not at the first step
        return regex
    if json_schema is not None:
        return schema_to_regex(json_schema)
    if choice is not None:
        if not isinstance(choice, list) or not choice or not all(isinstance(c, str) for c in choice):
            raise ValueError("guided_choice must be a non-empty list of strings")
        return "|".join(f"(?:{escape(c)})" for c in choice)
    return json_object_regex() if json_object else None


def min_tokens_problem(index: TokenIndex, min_tokens: int, room: int) -> str | None:
    """Why a request with this constraint and ``min_tokens`` (EOS not ignored) can never finish
    cleanly, or None when it may. ``room``: the most tokens the request can produce.

    Every token the index allows but EOS is at least one byte, so a pattern whose longest text is
    L bytes is complete (only EOS left) after at most L tokens. If min_tokens > L, EOS is still
    masked there and no token is left: decided now, unless the request runs out of room first
    (room <= L), which ends it by length before that point."""
    longest = index.longest_text
    if longest is None or min_tokens <= longest or room <= longest:
        return None
    return (f"min_tokens = {min_tokens} cannot be met: the constraint's longest text is {longest} bytes, and "
            f"every token is at least one byte, so the text is complete before {min_tokens} tokens while "
            f"min_tokens forbids ending it")


class Guide:
    """A DFA state over one token index, advanced token by token."""

    def __init__(self, index: TokenIndex):
        self.index = index
        self.tokenizer: Tokenizer = index.tokenizer
        self.state = 0
        self.tail = b""   # the last bytes written: does the text end inside a character?

    @classmethod
    def for_pattern(cls, pattern: str, tokenizer: Tokenizer) -> Guide:
        return cls(token_index(pattern, tokenizer))

    def allowed(self) -> np.ndarray:
        """(K,) sorted ids of the tokens that keep the output valid (EOS where it may end)."""
        return self.index.allowed(self.state)

    def advance(self, token_id: int) -> None:
        if token_id == self.index.eos_id and self.index.dfa.accepting[self.state]:
            return
        nxt = self.index.next_state(self.state, token_id)
        if nxt == DEAD:
            raise ValueError(f"token {token_id} ({self.tokenizer.id_to_bytes[token_id]!r}) breaks the "
                             f"constraint in state {self.state}")
        self.state = nxt
        self.tail = (self.tail + self.tokenizer.id_to_bytes[token_id])[-4:]

    @property
    def accepting(self) -> bool:
        return bool(self.index.dfa.accepting[self.state])

    def forced_tokens(self) -> list[int]:
        """The tokens jump-forward may append now without a forward ([EOS] once the text is complete)."""
        if self.index.is_complete(self.state):
            return [] if self.index.eos_id is None else [self.index.eos_id]
        if complete_utf8_length(self.tail) != len(self.tail):   # mid-character: let the model finish it
            return []
        data = self.index.forced_bytes(self.state)
        if not data:
            return []
        out, state = [], self.state
        for t in self.tokenizer.encode(data.decode("utf-8"), add_bos=False):
            state = self.index.next_state(state, t)
            if state == DEAD:   # e.g. text that spells a special token: stop before it
                break
            out.append(t)
        return out

