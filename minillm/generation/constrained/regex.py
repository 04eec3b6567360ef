"""A regular-expression parser for the subset that constrained decoding needs.

    pattern  ->  syntax tree of four node kinds

    Chars(ranges)            one character from a set of code-point ranges   a  [a-z0-9]  \\d  .
    Concat(parts)            the parts one after another                     ab
    Alternate(options)       any one of the options                          a|b
    Repeat(node, lo, hi)     node lo..hi times (hi None: unbounded)          a*  a+  a?  a{2,5}

Supported: literals, escapes (\\n \\t \\r \\f \\v \\0 \\xhh \\uhhhh \\Uhhhhhhhh and escaped
metacharacters), classes ``[...]`` with ranges and ``^`` negation, ``\\d \\w \\s`` and their
negations, ``.``, groups ``(...)`` and ``(?:...)``, ``* + ? {m} {m,} {m,n}``, ``|``. A pattern
always matches the whole text (as ``re.fullmatch``), so ``^`` at the very start and ``$`` at the
very end are accepted and change nothing.

Classes are ASCII, as Python's ``re.ASCII`` flag makes them: ``\\d`` is ``[0-9]``, ``\\w`` is
``[A-Za-z0-9_]``, ``\\s`` is ``[ \\t\\n\\r\\f\\v]``. ``.`` is any character but ``\\n``.
Anything else (lazy quantifiers, backreferences, lookaround, anchors inside, flags) raises
``RegexError`` naming the construct and its position: a constraint we cannot honour must never
silently become a weaker one. So does a pattern no text matches (``[\ud800]``: surrogates are
no text): its output could never be finished.

Parsing counts against the compile budget (budget.py): the nesting of groups as it descends, and
then the length the pattern stands for with its counted repeats unrolled (``(?:a{1000}){1000}``
is 19 characters standing for a million), which is what an NFA would be built from.
"""
from __future__ import annotations

from dataclasses import dataclass

from minillm.generation.constrained.budget import CompileBudget

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)   # not characters of any encodable text: never part of a set
MAX_REPEAT = 1000               # {m,n} copies the node: bound the copies

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent (lo, hi) code-point ranges


class RegexError(ValueError):
    """The pattern is malformed or uses a construct outside the supported subset."""


@dataclass(frozen=True)
class Chars:
    ranges: Ranges


@dataclass(frozen=True)
class Concat:
    parts: tuple


@dataclass(frozen=True)
class Alternate:
    options: tuple


@dataclass(frozen=True)
class Repeat:
    node: object
    lo: int
    hi: int | None


EMPTY = Concat(())


# -----------------------------------------------------------------------------------------------
# Character sets as range tuples


def normalize(ranges) -> Ranges:
    """Sort and merge overlapping or touching ranges; cut the surrogate block out."""
    out: list[list[int]] = []
    for lo, hi in sorted(ranges):
        for a, b in ((lo, min(hi, SURROGATES[0] - 1)), (max(lo, SURROGATES[1] + 1), hi)):
            if a > b:
                continue
            if out and a <= out[-1][1] + 1:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
    return tuple((a, b) for a, b in out)


def negate(ranges: Ranges) -> Ranges:
    """Every character not in `ranges`."""
    out, start = [], 0
    for lo, hi in normalize(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CODE_POINT:
        out.append((start, MAX_CODE_POINT))
    return normalize(out)


DIGIT = ((ord("0"), ord("9")),)
WORD = normalize([(ord("0"), ord("9")), (ord("A"), ord("Z")), (ord("_"), ord("_")), (ord("a"), ord("z"))])
SPACE = normalize([(9, 13), (32, 32)])                       # \t \n \v \f \r and the space
SHORTHANDS = {"d": DIGIT, "D": negate(DIGIT), "w": WORD, "W": negate(WORD), "s": SPACE, "S": negate(SPACE)}
SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0", "a": "\a"}
ANY_BUT_NEWLINE = negate(((10, 10),))


def literal(text: str):
    """The node matching exactly `text`."""
    return Concat(tuple(Chars(normalize(((ord(c), ord(c)),))) for c in text))


def escape(text: str) -> str:
    """`text` written as a pattern that matches it literally (every metacharacter escaped)."""
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/-" else c for c in text)


# -----------------------------------------------------------------------------------------------
# The parser: recursive descent, one method per precedence level


def parse(pattern: str, budget: CompileBudget | None = None):
    """The syntax tree of `pattern` (see the module docstring for the subset), within `budget`."""
    if not isinstance(pattern, str):
        raise RegexError(f"a pattern must be a string, got {type(pattern).__name__}")
    budget = CompileBudget() if budget is None else budget
    budget.count("regex_length", len(pattern))
    tree = _Parser(pattern, budget).parse()
    budget.count("expanded_length", expanded_length(tree))
    if matches_nothing(tree):
        raise RegexError(f"the pattern {pattern!r} matches no text (a class of surrogates alone is empty: "
                         f"they are no text)")
    return tree


def expanded_length(node) -> int:
    """The characters `node` stands for with every counted repeat unrolled: what Thompson's
    construction builds a fragment for (an unbounded repeat is one copy more than its minimum)."""
    if isinstance(node, Chars):
        return 1
    if isinstance(node, (Concat, Alternate)):
        return sum(map(expanded_length, node.parts if isinstance(node, Concat) else node.options))
    return expanded_length(node.node) * (node.lo + 1 if node.hi is None else node.hi)


def matches_nothing(node) -> bool:
    """No text matches `node` (an empty class, and whatever cannot avoid one)."""
    if isinstance(node, Chars):
        return not node.ranges
    if isinstance(node, Concat):
        return any(map(matches_nothing, node.parts))
    if isinstance(node, Alternate):
        return all(map(matches_nothing, node.options))
    return node.lo > 0 and matches_nothing(node.node)


class _Parser:
    def __init__(self, pattern: str, budget: CompileBudget):
        self.text, self.pos, self.budget, self.depth = pattern, 0, budget, 0

    def fail(self, what: str):
        raise RegexError(f"{what} at position {self.pos} of pattern {self.text!r}")

    def peek(self) -> str | None:
        return self.text[self.pos] if self.pos < len(self.text) else None

    def take(self) -> str:
        if self.pos >= len(self.text):
            self.fail("unexpected end of pattern")
        c = self.text[self.pos]
        self.pos += 1
        return c

    def parse(self):
        if self.peek() == "^":
            self.pos += 1
        node = self.alternation()
        if self.peek() == ")":
            self.fail("unbalanced ')'")
        if self.pos != len(self.text):
            self.fail(f"unexpected {self.peek()!r}")
        return node

    def alternation(self):
        options = [self.concatenation()]
        while self.peek() == "|":
            self.pos += 1
            options.append(self.concatenation())
        return options[0] if len(options) == 1 else Alternate(tuple(options))

    def concatenation(self):
        parts = []
        while (c := self.peek()) is not None and c not in "|)":
            if c == "$":
                self.pos += 1
                if self.pos != len(self.text):
                    self.fail("'$' is only supported at the end of the pattern")
                break
            parts.append(self.repetition())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def repetition(self):
        node, quantified = self.atom(), False
        while (c := self.peek()) is not None and c in "*+?{":
            start = self.pos
            if c == "{":
                bounds = self.braces()
                if bounds is None:    # a literal "{", as in Python
                    break
                lo, hi = bounds
            else:
                self.pos += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            if self.peek() in ("?", "+"):
                self.fail("lazy and possessive quantifiers are not supported (a mask has no preference)")
            if quantified:
                self.pos = start
                self.fail("a quantifier on a quantifier ('a**') is not supported; use a group")
            node, quantified = Repeat(node, lo, hi), True
        return node

    def braces(self) -> tuple[int, int | None] | None:
        """{m}, {m,}, {m,n} -> (m, n); anything else is the literal '{' (None)."""
        end = self.text.find("}", self.pos)
        body = self.text[self.pos + 1:end] if end > 0 else ""
        lo, comma, hi = body.partition(",")
        if end < 0 or not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        self.pos = end + 1
        m = int(lo)
        n = m if not comma else (int(hi) if hi else None)
        if n is not None and n < m:
            self.fail(f"bad repetition {{{body}}}: max below min")
        if max(m, n or 0) > MAX_REPEAT:
            self.fail(f"repetition {{{body}}} exceeds {MAX_REPEAT}")
        return m, n

    def atom(self):
        c = self.take()
        if c == "(":
            if self.peek() == "?":
                if self.text.startswith("?:", self.pos):
                    self.pos += 2
                else:
                    self.fail("only the non-capturing group '(?:' of the '(?' extensions is supported")
            self.depth += 1
            self.budget.count("nesting_depth", self.depth)   # before the recursion runs out of stack
            node = self.alternation()
            self.depth -= 1
            if self.peek() != ")":
                self.fail("missing ')'")
            self.pos += 1
            return node
        if c == "[":
            return Chars(self.char_class())
        if c == ".":
            return Chars(ANY_BUT_NEWLINE)
        if c == "\\":
            return Chars(normalize(self.escape_in(in_class=False)))
        if c in "*+?":
            self.pos -= 1
            self.fail(f"nothing to repeat before {c!r}")
        if c == "^":
            self.pos -= 1
            self.fail("'^' is only supported at the start of the pattern")
        return Chars(normalize(((ord(c), ord(c)),)))   # a lone surrogate: the empty set

    def char_class(self) -> Ranges:
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges, first = [], True
        while True:
            c = self.take()
            if c == "]" and not first:
                break
            first = False
            if c == "\\":
                lo_set = self.escape_in(in_class=True)
            elif c == "[" and self.peek() == ":":
                self.fail("POSIX classes ('[:alpha:]') are not supported")
            else:
                lo_set = ((ord(c), ord(c)),)
            if self.peek() == "-" and self.pos + 1 < len(self.text) and self.text[self.pos + 1] != "]":
                self.pos += 1
                d = self.take()
                hi_set = self.escape_in(in_class=True) if d == "\\" else ((ord(d), ord(d)),)
                if len(lo_set) != 1 or lo_set[0][0] != lo_set[0][1] or len(hi_set) != 1 or hi_set[0][0] != hi_set[0][1]:
                    self.fail("a class shorthand cannot bound a range")
                lo, hi = lo_set[0][0], hi_set[0][0]
                if hi < lo:
                    self.fail(f"bad range {chr(lo)!r}-{chr(hi)!r}")
                ranges.append((lo, hi))
            else:
                ranges.extend(lo_set)
        return negate(tuple(ranges)) if negated else normalize(ranges)

    def escape_in(self, in_class: bool) -> Ranges:
        c = self.take()
        if c in SHORTHANDS:
            return SHORTHANDS[c]
        if c in SIMPLE_ESCAPES:
            code = ord(SIMPLE_ESCAPES[c])
        elif c == "b" and in_class:
            code = 8
        elif c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.text[self.pos:self.pos + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"\\{c} needs {width} hex digits")
            self.pos += width
            code = int(digits, 16)
            if code > MAX_CODE_POINT:
                self.fail(f"\\{c}{digits} is beyond the last code point")
        elif c.isalnum():
            self.fail(f"the escape \\{c} is not supported (backreferences, anchors and \\p{{...}} are not)")
        else:
            code = ord(c)   # an escaped metacharacter or punctuation stands for itself
        return ((code, code),)   # not normalized yet: a surrogate may still bound a range
