"""Stop strings (cullama/text/stop_strings.py): what is held back and where the text ends, against a plain
reference on random streams, and the work a token costs, counted in lines of Python run (not timed)."""

from __future__ import annotations

import random
import sys

import pytest

from cullama.text import stop_strings
from cullama.text.stop_strings import StopMatcher


def reference(chunks: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    """The pieces a stream emits, written plainly: after each chunk, the text up to the first point where a
    stop string has been written in full (the longest of those ending there), else everything but the
    longest tail that a stop string starts with. Returns (pieces, the stop string that matched)."""
    stops = [s for s in stops if s]
    text, sent, pieces = "", 0, []
    for chunk in chunks:
        for i in range(len(chunk)):
            text += chunk[i]
            ending = [s for s in stops if text.endswith(s)]
            if ending:
                found = max(ending, key=len)
                pieces.append(text[sent:len(text) - len(found)])
                return pieces, found
        keep = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        pieces.append(text[sent:len(text) - keep])
        sent = len(text) - keep
    pieces.append(text[sent:])  # flush
    return pieces, None


def run(chunks: list[str], stops: list[str]) -> tuple[list[str], str | None]:
    matcher = StopMatcher(stops)
    pieces = []
    for chunk in chunks:
        pieces.append(matcher.feed(chunk))
        if matcher.stopped:
            return pieces, matcher.matched
    return pieces + [matcher.flush()], None


def test_random_streams_hold_back_and_cut_as_the_reference_does():
    rng = random.Random(19)
    for trial in range(3000):
        alphabet = "ab\n" if trial % 2 else "abcé€😀"  # few letters: stop strings overlap and recur
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(0, 4))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(6, len(text)))))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert run(chunks, stops) == reference(chunks, stops), (chunks, stops)


@pytest.mark.parametrize("chunks, stops, pieces, matched", [
    (["ab", "c", "d"], ["cx"], ["ab", "", "cd", ""], None),  # "c" is held back until "d" rules out "cx"
    (["Hello wor", "ld!"], ["world", "xyz"], ["Hello ", ""], "world"),
    (["abcd"], ["abcd", "bc"], ["a"], "bc"),  # "bc" is written in full first
    (["xabc"], ["bc", "abc"], ["x"], "abc"),  # both end at the same character: the longer one
    (["aab"], ["ab", "ab", ""], ["a"], "ab"),  # the same string twice, and an empty one: harmless
])
def test_where_the_text_ends(chunks, stops, pieces, matched):
    assert run(chunks, stops) == (pieces, matched)


class LineBudget:
    """Counts the lines of Python run inside cullama/text/stop_strings.py, and stops the test once there are more
    than `budget`: a matcher whose work per token grows with the number or length of the stop strings fails
    at once, rather than running for minutes."""

    class Spent(Exception):
        pass

    def __init__(self, budget: int):
        self.budget, self.lines = budget, 0

    def _local(self, frame, event, arg):
        if event == "line":
            self.lines += 1
            if self.lines > self.budget:
                raise LineBudget.Spent(f"more than {self.budget} lines")
        return self._local

    def _global(self, frame, event, arg):
        return self._local if frame.f_code.co_filename == stop_strings.__file__ else None

    def __enter__(self):
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)


def test_a_token_costs_its_characters_and_the_longest_stop_however_many_stops_there_are():
    # 200 stop strings of 1000 characters, and one that the whole text keeps beginning: every token is held
    # back, and each could still begin any of the 200. The text: 400 tokens of 5 characters.
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefgh") for _ in range(2000))
    stops = ["".join(rng.choice("abcdefgh") for _ in range(1000)) for _ in range(200)] + [text + "!"]
    matcher = StopMatcher(stops)
    with LineBudget(budget=30 * len(text)) as counted:  # a few lines per character fed
        emitted = [matcher.feed(text[i:i + 5]) for i in range(0, len(text), 5)]
    assert "".join(emitted) == "" and matcher.pending == text and not matcher.stopped
    assert counted.lines > len(text)  # it did count the walk
    assert matcher.feed("!") == "" and matcher.matched == stops[-1]


def test_flush_gives_back_what_was_held_and_starts_afresh():
    # "a" is held back (it may begin "ab"); after flush, a "b" is new text, not the end of "ab". (The last
    # node, "ca", links to "a": a state left anywhere but the root would see "ab".)
    matcher = StopMatcher(["ab", "ca"])
    assert matcher.feed("a") == "" and matcher.flush() == "a"
    assert matcher.feed("b") == "b" and not matcher.stopped and matcher.pending == ""
    assert matcher.feed("c") == "" and matcher.flush() == "c"
    assert matcher.feed("xab") == "x" and matcher.matched == "ab"
