"""Automata drawn as graphs with matplotlib alone (no graphviz binary): chapter 11's pictures.

    draw_automaton(thompson(parse("(a|b)*abb")), "Thompson NFA")    # an NFA: epsilon moves as ε
    draw_automaton(compile_dfa("(a|b)*abb"), "minimal DFA")         # a DFA: one arrow per target
    draw_automaton(compile_byte_dfa("é|中"), "bytes", alphabet="bytes")

States are circles numbered as the automaton numbers them, accepting ones doubled, the start
marked by an arrow from nowhere. The layout puts states in columns by their breadth-first
distance from the start, so an automaton reads left to right the way its input is read. Every
arrow carries the symbols that take it, written as a regex class (``[0-9]``, ``[^"\\\\]``).
"""
from __future__ import annotations

from collections import deque

from minillm.generation.constrained.automata import DEAD, DFA, MAX_SYMBOL, NFA
from minillm.generation.constrained.regex import negate, normalize

EPSILON = None     # the "symbols" of an epsilon move
RADIUS = 0.28      # a state's circle, in layout units (columns are 1.6 apart, rows 1.1)
COLUMN, ROW = 1.6, 1.1


def transitions(automaton: NFA | DFA) -> dict[tuple[int, int], tuple | None]:
    """(state, target) -> the symbol ranges that move state to target, merged (None: an epsilon move)."""
    moves: dict[tuple[int, int], list] = {}
    if isinstance(automaton, NFA):
        for s, edges in enumerate(automaton.edges):
            for lo, hi, t in edges:
                moves.setdefault((s, t), []).append((lo, hi))
        out: dict[tuple[int, int], tuple | None] = {key: normalize(r) for key, r in moves.items()}
        for s, targets in enumerate(automaton.eps):
            for t in targets:
                out[(s, t)] = EPSILON   # Thompson's construction never puts both on one pair
        return out
    for s in range(automaton.num_states):
        for k, t in enumerate(automaton.table[s]):
            if t != DEAD:
                moves.setdefault((s, int(t)), []).append(automaton.class_ranges(k))
    return {key: normalize(r) for key, r in moves.items()}


def ranges_label(ranges: tuple | None, alphabet: str = "chars") -> str:
    """Symbol ranges as a regex class: ``a``, ``[ab]``, ``[0-9]``, ``[^\\n]`` (the complement when
    that is shorter), ``ε`` for an epsilon move. ``alphabet="bytes"`` writes symbols above 0x7F as
    ``\\xNN`` and takes 0..255 as the whole alphabet."""
    if ranges is EPSILON:
        return "ε"
    top = 0xFF if alphabet == "bytes" else MAX_SYMBOL
    ranges = tuple((lo, min(hi, top)) for lo, hi in ranges if lo <= top)
    size = sum(hi - lo + 1 for lo, hi in ranges)
    negated = size > (top + 1) // 2
    if negated:   # the complement within the alphabet
        shown = [(lo, min(hi, top)) for lo, hi in negate(ranges) if lo <= top]
        if not shown:
            return "any"
    else:
        shown = list(ranges)
    if not negated and len(shown) == 1 and shown[0][0] == shown[0][1]:
        return _symbol(shown[0][0], alphabet, ".^$|?*+()[]{}\\")
    body = "".join(_symbol(lo, alphabet, CLASS_SPECIAL) + ("" if lo == hi else ("" if hi == lo + 1 else "-")
                                                         + _symbol(hi, alphabet, CLASS_SPECIAL))
                   for lo, hi in shown)
    return ("[^" if negated else "[") + body + "]"


CLASS_SPECIAL = "]\\^-["
NAMED = {"\n": "\\n", "\t": "\\t", "\r": "\\r", " ": "␣"}


def _symbol(code: int, alphabet: str, special: str) -> str:
    """One symbol as a regex writes it; `special` are the characters that need a backslash there."""
    if alphabet == "bytes" and code > 0x7F:
        return f"\\x{code:02x}"
    c = chr(code)
    if c in NAMED:
        return NAMED[c]
    if c in special:
        return "\\" + c
    if not c.isprintable():
        return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"
    return c


def layout(num_states: int, start: int, edges) -> dict[int, tuple[float, float]]:
    """State -> (x, y): column = breadth-first distance from the start, rows centred in each column.
    States the start cannot reach go in one last column."""
    successors: dict[int, list[int]] = {}
    for s, t in sorted(edges):
        successors.setdefault(s, []).append(t)
    depth, queue = {start: 0}, deque([start])
    while queue:
        s = queue.popleft()
        for t in successors.get(s, []):
            if t not in depth:
                depth[t] = depth[s] + 1
                queue.append(t)
    last, found = max(depth.values()) + 1, {s: i for i, s in enumerate(depth)}   # depth is in discovery order
    columns: dict[int, list[int]] = {}
    for s in sorted(range(num_states), key=lambda s: (depth.get(s, last), found.get(s, num_states + s))):
        columns.setdefault(depth.get(s, last), []).append(s)
    return {s: (COLUMN * d, ROW * ((len(states) - 1) / 2 - i))
            for d, states in columns.items() for i, s in enumerate(states)}


def automaton_figure(automaton: NFA | DFA, title: str = "", alphabet: str = "chars"):
    """The figure of an NFA or a DFA (see the module docstring)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Circle, FancyArrowPatch

    if isinstance(automaton, NFA):
        num_states, start, accepting = automaton.num_states, automaton.start, {automaton.accept}
    else:
        num_states, start = automaton.num_states, 0
        accepting = {int(s) for s in range(num_states) if automaton.accepting[s]}
    moves = transitions(automaton)
    at = layout(num_states, start, moves)
    xs, ys = [p[0] for p in at.values()], [p[1] for p in at.values()]
    width, height = max(xs) - min(xs) + 2 * COLUMN, max(ys) - min(ys) + 2 * ROW
    fig, ax = plt.subplots(figsize=(max(4.0, 1.1 * width), max(2.2, 1.1 * height)))
    circles = {}
    for s, (x, y) in at.items():
        circles[s] = Circle((x, y), RADIUS, facecolor="#dbe9f6" if s in accepting else "white", edgecolor="0.2",
                            lw=1.2, zorder=3)
        ax.add_patch(circles[s])
        if s in accepting:
            ax.add_patch(Circle((x, y), RADIUS * 0.8, fill=False, edgecolor="0.2", lw=1.0, zorder=4))
        ax.text(x, y, str(s), ha="center", va="center", fontsize=10, zorder=5)
    x0, y0 = at[start]
    ax.add_patch(FancyArrowPatch((x0 - 0.9, y0), (x0, y0), patchB=circles[start], arrowstyle="-|>",
                                 mutation_scale=12, color="0.2"))
    for (s, t), ranges in sorted(moves.items()):
        label = ranges_label(ranges, alphabet)
        color = "0.55" if ranges is EPSILON else "tab:blue"
        (x1, y1), (x2, y2) = at[s], at[t]
        if s == t:   # a loop over the top of the circle
            a, b = (x1 - 0.6 * RADIUS, y1 + 0.8 * RADIUS), (x1 + 0.6 * RADIUS, y1 + 0.8 * RADIUS)
            ax.add_patch(FancyArrowPatch(a, b, connectionstyle="arc3,rad=-1.8", arrowstyle="-|>",
                                         mutation_scale=10, color=color, lw=1.0))
            ax.text(x1, y1 + 2.0 * RADIUS, label, ha="center", va="bottom", fontsize=9, color="0.1")
            continue
        # Straight to the next column; curved when the move goes back, skips a column, stays in its
        # column or has a partner the other way, so that arrows do not run through states or each other.
        straight = abs((x2 - x1) - COLUMN) < 1e-9 and (t, s) not in moves
        rad = 0.0 if straight else 0.4 if x1 == x2 else 0.3   # within a column: bow out past the state between
        ax.add_patch(FancyArrowPatch((x1, y1), (x2, y2), patchA=circles[s], patchB=circles[t],
                                     connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>", mutation_scale=10,
                                     color=color, lw=1.0, zorder=2))
        # the middle of matplotlib's arc3 curve: the chord's midpoint moved by rad/2 of the chord, turned
        mx, my = (x1 + x2) / 2 + rad / 2 * (y2 - y1), (y1 + y2) / 2 - rad / 2 * (x2 - x1)
        ax.text(mx, my, label, ha="center", va="center", fontsize=9, color="0.1", zorder=6,
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    ax.set_xlim(min(xs) - 1.1, max(xs) + 0.7)
    ax.set_ylim(min(ys) - 0.9, max(ys) + 0.9)
    ax.set_aspect("equal")   # arc3 bends in display space: equal scales keep the labels on the arrows
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11)
    fig.tight_layout()
    return fig


def draw_automaton(automaton: NFA | DFA, title: str = "", alphabet: str = "chars") -> None:
    """Show the automaton's figure and return None (a returned figure would be drawn twice in a notebook)."""
    import matplotlib.pyplot as plt

    automaton_figure(automaton, title, alphabet)
    plt.show()
