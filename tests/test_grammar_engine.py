"""The grammar engine against oracles: the pushdown automaton against json.loads and a bracket
counter, its token masks against a brute-force walk of every token, its closing texts against
json.loads, and the guide's jump-forward against its own masks."""
import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.generation.constrained.grammar import Grammar, GrammarError, Ref
from minillm.generation.constrained.grammar_guide import GrammarGuide
from minillm.generation.constrained.grammar_mask import GrammarIndex
from minillm.generation.constrained.json_grammar import json_object_grammar
from minillm.generation.constrained.pushdown import Pushdown
from minillm.generation.constrained.regex import Alternate, Concat, Repeat, literal, parse
from minillm.generation.tokenizer import BYTE_TO_SYMBOL, Tokenizer

JSON = Pushdown(json_object_grammar())
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                           | st.text(max_size=5), lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=8)


def balanced():
    """S -> ( '(' S ')' )* : balanced parentheses, which no DFA accepts."""
    g = Grammar("s")
    g.rules["s"] = Repeat(Concat((literal("("), Ref("s"), literal(")"))), 0, None)
    return Pushdown(g)


def is_balanced(text: str) -> bool:
    depth = 0
    for c in text:
        depth += 1 if c == "(" else -1
        if depth < 0:
            return False
    return depth == 0


def test_balanced_parentheses_exhaustively():
    p = balanced()
    texts = [""]
    for _ in range(8):
        texts = texts + [t + c for t in texts if len(t) == max(map(len, texts)) for c in "()"]
    for text in texts:
        assert p.fullmatch(text.encode()) == is_balanced(text), text


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=4), json_values, max_size=4), st.sampled_from([(",", ":"), (", ", ": ")]))
def test_every_json_object_is_accepted(obj, separators):
    text = json.dumps(obj, separators=separators, ensure_ascii=False)
    assert JSON.fullmatch(text.encode()), text


def canonical_strings(text: str) -> bool:
    """Every string is spelled as json.dumps(ensure_ascii=False) spells it (our one spelling)."""
    try:
        return all(json.dumps(json.loads(s), ensure_ascii=False) == s for s in re.findall(r'"(?:[^"\\]|\\.)*"', text))
    except ValueError:
        return False


def layout_ok(text: str) -> bool:
    """Outside strings, whitespace is only ever one space right after ',' or ':' (our layout)."""
    in_string, escaped, previous = False, False, ""
    for i, c in enumerate(text):
        if in_string:
            in_string = escaped or c != '"'
            escaped = not escaped and c == "\\"
        elif c == '"':
            in_string = True
        elif c in " \t\n\r" and (c != " " or previous not in ",:"):
            return False
        previous = c if not in_string or c == '"' else ""
    return True


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=3), json_values, max_size=3), st.data())
def test_mutated_texts_agree_with_json_loads(obj, data):
    """A byte dropped, doubled or replaced: accepted exactly when json.loads reads an object, the
    whitespace keeps our layout and the strings their one spelling."""
    text = json.dumps(obj, ensure_ascii=False)
    i = data.draw(st.integers(0, len(text) - 1))
    c = data.draw(st.sampled_from('{}[]",:0-.e tfn\\a'))
    for mutated in (text[:i] + text[i + 1:], text[:i] + text[i] + text[i:], text[:i] + c + text[i + 1:]):
        expected = is_json_object(mutated) and layout_ok(mutated) and canonical_strings(mutated)
        assert JSON.fullmatch(mutated.encode("utf-8", "surrogatepass")) == expected, mutated


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.text(max_size=3), json_values, min_size=1, max_size=3), st.data())
def test_closing_text_completes_any_prefix(obj, data):
    text = json.dumps(obj, ensure_ascii=False).encode()
    cut = data.draw(st.integers(0, len(text) - 1))
    configs = JSON.walk(text[:cut])
    assert configs
    config = min(JSON.reading(configs), key=JSON.closing_cost)
    closing = JSON.closing_text(config)
    assert len(closing) == JSON.closing_cost(config)
    assert is_json_object((text[:cut] + closing).decode()), (text[:cut], closing)


def test_left_recursion_and_empty_languages_are_refused():
    g = Grammar("e")
    g.rules["e"] = Alternate((Concat((Ref("e"), literal("+1"))), literal("1")))
    with pytest.raises(GrammarError, match="left-recursive"):
        Pushdown(g)
    g = Grammar("a")
    g.rules["a"] = Concat((literal("x"), Ref("a")))     # never ends
    with pytest.raises(GrammarError, match="empty"):
        Pushdown(g)
    g = Grammar("a")
    g.rules["a"] = Ref("b")
    with pytest.raises(GrammarError, match="'b'"):
        Pushdown(g)


# ---- masks --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """Every single byte, merged tokens that cross rule boundaries, one ending inside 'é', an EOS."""
    symbols = [BYTE_TO_SYMBOL[b] for b in range(256)]
    merged = ['{"', '":', '": ', '"}', '"},', '}]', '},', '[[', '1,', ', "', 'true', 'é"', "\"a", "a\""]
    extra = ["".join(BYTE_TO_SYMBOL[b] for b in m.encode()) for m in merged]
    extra.append(BYTE_TO_SYMBOL[ord("a")] + BYTE_TO_SYMBOL["é".encode()[0]])
    tokens = symbols + extra + ["<|end|>"]
    eos = len(tokens) - 1
    return Tokenizer(tokens, [], [r"\S+|\s+"], added_ids=[eos], special_ids=[eos], eos_id=eos)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return Tokenizer.from_gguf(smollm2_path)


def brute_force(p: Pushdown, tokenizer, configs) -> list[int]:
    excluded = set(tokenizer.added_ids) | set(tokenizer.special_ids)
    ids = [t for t in range(tokenizer.vocab_size)
           if t not in excluded and tokenizer.id_to_bytes[t] and p.walk(tokenizer.id_to_bytes[t], configs)]
    return sorted(set(ids) | ({tokenizer.eos_id} if p.can_end(configs) else set()))


PREFIXES = [b"", b"{", b'{"a', b'{"a": ', b'{"a": 1', b'{"a": [', b'{"a": [[1, "x"', b'{"a": {"b": tr',
            b'{"a": 1}', b'{"\xc3', b'{"a": [{}, "\\']


def test_masks_match_brute_force_on_a_tiny_vocabulary(tiny_tokenizer):
    index = GrammarIndex(JSON, tiny_tokenizer)
    for prefix in PREFIXES:
        configs = JSON.walk(prefix)
        assert list(index.allowed(configs)) == brute_force(JSON, tiny_tokenizer, configs), prefix


def test_closing_costs_after_each_token(tiny_tokenizer):
    """The walks' closing bytes after each allowed token equal the automaton's, token by token."""
    index = GrammarIndex(JSON, tiny_tokenizer)
    for prefix in PREFIXES:
        configs = JSON.walk(prefix)
        ids, costs = index.allowed_with_costs(configs)
        for t, cost in zip(ids, costs):
            if t == tiny_tokenizer.eos_id:
                continue
            after = JSON.reading(JSON.walk(tiny_tokenizer.id_to_bytes[t], configs))
            assert cost == min(map(JSON.closing_cost, after)), (prefix, tiny_tokenizer.id_to_bytes[t])


def test_masks_match_brute_force_on_smollm2(smollm2_tokenizer):
    index = GrammarIndex(JSON, smollm2_tokenizer)
    for prefix in PREFIXES[:9]:
        configs = JSON.walk(prefix)
        assert list(index.allowed(configs)) == brute_force(JSON, smollm2_tokenizer, configs), prefix


def test_the_split_is_exact(tiny_tokenizer):
    """Tokens called independent of the stack are allowed under any stack; dependent ones under some."""
    index = GrammarIndex(JSON, tiny_tokenizer)
    for prefix in (b'{"a": [1', b'{"a": {"b": "c'):
        for g, stack in JSON.walk(prefix):
            independent, _, dependent = index.split(g)
            assert not set(independent) & set(dependent)
            for t in independent:
                assert JSON.walk(tiny_tokenizer.id_to_bytes[t], {(g, stack)})


def test_guide_jump_forward_and_closing(tiny_tokenizer):
    index = GrammarIndex(JSON, tiny_tokenizer)
    guide = GrammarGuide(index)
    assert guide.forced_tokens() == [tiny_tokenizer.token_to_id["{"]]   # an object must open
    rng = np.random.default_rng(0)
    for _ in range(12):
        allowed = guide.allowed()
        guide.advance(int(rng.choice([t for t in allowed if t != tiny_tokenizer.eos_id])))
        for t in guide.forced_tokens():
            assert t in guide.allowed() or t == tiny_tokenizer.eos_id
            if t != tiny_tokenizer.eos_id:
                guide.advance(t)


@pytest.mark.parametrize("max_tokens", [3, 6, 10, 20])
def test_budget_aware_closing_ends_valid(tiny_tokenizer, max_tokens):
    """Free choices until the budget is down to the closing text; at max_tokens the text parses."""
    rng = np.random.default_rng(max_tokens)
    guide, out, eos = GrammarGuide(GrammarIndex(JSON, tiny_tokenizer), max_tokens=max_tokens), b"", tiny_tokenizer.eos_id
    while guide.num_tokens < max_tokens:
        allowed = [t for t in guide.allowed() if t != eos]
        if not allowed:
            break
        # prefer tokens that open structures: the hardest text to close in time
        openers = [t for t in allowed if tiny_tokenizer.id_to_bytes[t][:1] in (b"[", b"{", b'"')]
        t = int(rng.choice(openers if openers and rng.random() < 0.7 else allowed))
        guide.advance(t)
        out += tiny_tokenizer.id_to_bytes[t]
    assert is_json_object(out.decode()), out
