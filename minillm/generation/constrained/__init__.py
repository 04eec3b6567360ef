"""Structured output: constraints (regex, JSON Schema, choices) compiled into token masks.

    regex.py        the regex subset -> syntax tree
    automata.py     syntax tree -> Thompson NFA -> DFA (subset construction) -> minimal DFA
    json_schema.py  JSON Schema -> regex (tool calls still use it)
    grammar.py      a grammar: rules as regex trees with references to other rules
    pushdown.py     the rules' DFAs as one pushdown automaton over bytes, with closing lengths
    grammar_mask.py its token masks: per state, the tokens the stack cannot change, cached
    json_grammar.py JSON Schema -> grammar (guided_json, response_format, json_object)
    dfa_ops.py      byte DFAs intersected and complemented
    grammar_guide.py one sequence's parse: masks, jump-forward, budget-aware closing
    token_index.py  byte DFA x vocabulary -> allowed tokens and next state per DFA state
    guide.py        one sequence's state: its mask each step, and jump-forward
    budget.py       the bounds every stage counts against as it compiles
"""
from minillm.generation.constrained.automata import DFA, compile_byte_dfa, compile_dfa
from minillm.generation.constrained.budget import CompileBudget, ConstraintTooLarge
from minillm.generation.constrained.grammar_guide import GrammarGuide, JsonGrammar
from minillm.generation.constrained.guide import Guide, constraint_index, guided_pattern, min_tokens_problem, new_guide
from minillm.generation.constrained.json_schema import SchemaError, schema_to_regex
from minillm.generation.constrained.regex import RegexError
from minillm.generation.constrained.token_index import TokenIndex, token_index

__all__ = ["DFA", "CompileBudget", "ConstraintTooLarge", "GrammarGuide", "Guide", "JsonGrammar", "RegexError",
           "SchemaError", "TokenIndex", "compile_byte_dfa", "compile_dfa", "constraint_index", "guided_pattern",
           "min_tokens_problem", "new_guide", "schema_to_regex", "token_index"]
