"""Stop strings: removed from the text, found even when they span pieces, nothing else held back."""
import random

import pytest

from minillm.generation.stop import StopStringFilter


def stream(pieces, stops):
    f = StopStringFilter(stops)
    out = "".join(f.push(p) for p in pieces)
    return out + f.flush(), f.stopped


def expected(text, stops):
    """The fact to check against: cut at the first occurrence of any stop string."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


@pytest.mark.parametrize("text,stops", [
    ("Hello world. The end.", ["."]),
    ("Paris is the capital<|end|> of France", ["<|end|>"]),
    ("abcabcabd", ["abd"]),
    ("no stop here", ["STOP", "halt"]),
    ("x\n\nUser: hi", ["\n\nUser:", "\n\n"]),
    ("aaaa", ["aab"]),
])
def test_every_split_of_the_text_gives_the_same_answer(text, stops):
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, len(text) - 1)))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        assert stream(pieces, stops) == expected(text, stops)


def test_text_is_released_as_soon_as_it_cannot_start_a_stop():
    f = StopStringFilter(["<|end|>"])
    assert f.push("Hello <|") == "Hello "
    assert f.push("en") == ""
    assert f.push("x") == "<|enx"


def test_nothing_after_the_stop_is_released():
    f = StopStringFilter(["END"])
    assert f.push("aEND") == "a"
    assert f.push("more") == "" and f.flush() == ""


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="non-empty"):
        StopStringFilter([""])


def test_stop_lists_are_bounded_in_count_and_length():
    from minillm.generation.stop import MAX_STOP_LENGTH, MAX_STOP_STRINGS, check_stop_strings
    check_stop_strings(["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS)
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS}"):
        StopStringFilter([f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_LENGTH}"):
        StopStringFilter(["x" * (MAX_STOP_LENGTH + 1)])


def test_the_work_per_piece_does_not_grow_with_the_completion():
    f = StopStringFilter(["b" * 256] * 16)
    for _ in range(20_000):
        f.push("a")
        assert f.pending == ""  # nothing held back, so nothing old is searched again
