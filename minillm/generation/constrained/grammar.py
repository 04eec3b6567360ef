"""A context-free grammar whose rules are regular expressions over bytes and rule references.

    grammar = Grammar("value")
    grammar.rules["value"] = Alternate((Ref("array"), literal("null")))
    grammar.rules["array"] = Concat((literal("["), Repeat(Ref("value"), 0, None), literal("]")))

A rule's body is a syntax tree of regex.py (Chars, Concat, Alternate, Repeat) that may also hold
``Ref(name)``: the whole of another rule at that point. That is EBNF (GBNF, as llama.cpp writes it)
with the regex operators inside a rule. Each rule compiles, with automata.py's constructions, to
one minimal DFA over an alphabet of the 256 byte values plus one symbol per rule (a move on the
symbol of rule R means "R's text goes here"): the regex part of a rule is the lexer, the
references are the part a DFA cannot do. pushdown.py runs those DFAs with a stack of return states.

A rule may also be given directly as a byte DFA without references (``Terminal``), for a language
built by other means (the intersection of two DFAs, the residues of a ``multipleOf``).

``Grammar.unique`` names the rules that are JSON arrays whose items must be distinct
(``uniqueItems``): no context-free grammar can say that, so the rule holds the items' language and
unique_items.py enforces the rest at run time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minillm.generation.constrained.automata import DFA, determinize, minimize, thompson, utf8_sequences
from minillm.generation.constrained.budget import CompileBudget
from minillm.generation.constrained.regex import Alternate, Chars, Concat, Repeat

REF_BASE = 256   # symbol REF_BASE + k stands for rule k; 0..255 are bytes


class GrammarError(ValueError):
    """The grammar cannot be compiled: a missing rule, an empty language, left recursion."""


@dataclass(frozen=True)
class Ref:
    name: str


@dataclass(frozen=True)
class Terminal:
    """A rule given as a byte DFA (no references)."""
    dfa: DFA = field(compare=False)
    key: str   # what the DFA stands for: equal keys, equal languages (rules are shared by key)


@dataclass(frozen=True)
class UniqueItems:
    """What a rule "[" item ("," " "? item)* "]" leaves to the run time: its items, each a text of
    the byte DFA `item` (scalars only: strings, numbers without exponent, true, false, null),
    must be distinct values, and there are at least `min_items` of them."""
    item: DFA = field(compare=False)
    min_items: int


@dataclass
class Grammar:
    start: str
    rules: dict[str, object] = field(default_factory=dict)
    unique: dict[str, UniqueItems] = field(default_factory=dict)   # rule name -> its uniqueItems


def byte_tree(node, rule_number: dict[str, int]):
    """`node` over code points -> the same language over UTF-8 bytes, references as symbols."""
    if isinstance(node, Ref):
        if node.name not in rule_number:
            raise GrammarError(f"rule {node.name!r} is referenced but not defined")
        k = REF_BASE + rule_number[node.name]
        return Chars(((k, k),))
    if isinstance(node, Chars):
        options = []
        for lo, hi in node.ranges:
            for seq in utf8_sequences(lo, hi):
                options.append(Concat(tuple(Chars(((a, b),)) for a, b in seq)))
        return options[0] if len(options) == 1 else Alternate(tuple(options))
    if isinstance(node, Concat):
        return Concat(tuple(byte_tree(p, rule_number) for p in node.parts))
    if isinstance(node, Alternate):
        return Alternate(tuple(byte_tree(o, rule_number) for o in node.options))
    if isinstance(node, Repeat):
        return Repeat(byte_tree(node.node, rule_number), node.lo, node.hi)
    raise TypeError(f"not a grammar node: {node!r}")


def reachable_rules(grammar: Grammar) -> list[str]:
    """The rules the start rule uses, directly or not, the start rule first (others are left out)."""
    names, todo = [grammar.start], [grammar.rules[grammar.start]]
    while todo:
        node = todo.pop()
        if isinstance(node, Ref):
            if node.name not in grammar.rules:
                raise GrammarError(f"rule {node.name!r} is referenced but not defined")
            if node.name not in names:
                names.append(node.name)
                todo.append(grammar.rules[node.name])
        elif isinstance(node, Concat):
            todo.extend(node.parts)
        elif isinstance(node, Alternate):
            todo.extend(node.options)
        elif isinstance(node, Repeat):
            todo.append(node.node)
    return names


def compile_rules(grammar: Grammar, budget: CompileBudget | None = None) -> tuple[list[str], list[DFA]]:
    """Every rule's minimal DFA over bytes + rule symbols, the start rule first."""
    budget = budget or CompileBudget()
    if grammar.start not in grammar.rules:
        raise GrammarError(f"the start rule {grammar.start!r} is not defined")
    names = reachable_rules(grammar)
    budget.count("grammar_rules", len(names))
    number = {n: k for k, n in enumerate(names)}
    dfas = []
    for name in names:
        body = grammar.rules[name]
        if isinstance(body, Terminal):
            dfas.append(body.dfa)
        else:
            nfa = thompson(byte_tree(body, number))
            budget.count("nfa_states", nfa.num_states)
            dfa = minimize(determinize(nfa))
            budget.count("dfa_states", dfa.num_states)
            dfas.append(dfa)
        budget.check_time()
    return names, dfas
