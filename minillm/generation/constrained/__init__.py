"""Structured output: constraints (regex, JSON Schema, choices) compiled into token masks.

    regex.py        the regex subset -> syntax tree
    automata.py     syntax tree -> Thompson NFA -> DFA (subset construction) -> minimal DFA
    json_schema.py  JSON Schema -> regex
    token_index.py  byte DFA x vocabulary -> allowed tokens and next state per DFA state
    guide.py        one sequence's state: its mask each step, and jump-forward
    budget.py       the bounds every stage counts against as it compiles
"""
from minillm.generation.constrained.automata import DFA, compile_byte_dfa, compile_dfa
from minillm.generation.constrained.budget import CompileBudget, ConstraintTooLarge
from minillm.generation.constrained.guide import Guide, guided_pattern, min_tokens_problem
from minillm.generation.constrained.json_schema import SchemaError, schema_to_regex
from minillm.generation.constrained.regex import RegexError
from minillm.generation.constrained.token_index import TokenIndex, token_index

__all__ = ["DFA", "CompileBudget", "ConstraintTooLarge", "Guide", "RegexError", "SchemaError", "TokenIndex",
           "compile_byte_dfa", "compile_dfa", "guided_pattern", "min_tokens_problem", "schema_to_regex", "token_index"]
