"""Stop strings in streamed text: hold back what might still become one, cut at the first that appears.

    matcher = StopMatcher(["\\n\\n", "User:"])
    safe = matcher.feed(piece)    # text that can no longer be part of a stop string
    matcher.stopped, matcher.matched

Every stop string goes into one Aho-Corasick automaton (a trie of the strings with, at each node, a link
to the longest proper suffix of its text that is also a node), built once per generation in time linear in
their total length. Feeding text walks it one character at a time, so a token costs O(its characters + the
longest stop string) however many stop strings there are: the state's depth is at once the length of the
text to hold back (the longest tail that some stop string starts with) and never more than the longest
stop string, and the first node that completes a stop string ends the text. A stop string ends the text
at the first point where one has been written in full; where several end at that same character, the
longest one counts (it starts earliest).
"""

from __future__ import annotations

from typing import Sequence

_CHARS = 0x110000  # goto's key of (state, character): state * _CHARS + code point, one int, no tuple


class StopMatcher:
    """Holds back streamed text that might still turn into a stop string; cuts at the first one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in dict.fromkeys(stops) if s]  # in order, once each; "" never matches
        self.pending = ""  # text held back: the last depth[state] characters fed
        self.stopped = False
        self.matched: str | None = None  # the stop string that was found
        self._state = 0
        self._build()

    def _build(self) -> None:
        # Node 0 is the root (the empty string). goto[state * _CHARS + ord(c)] = the child spelling c next.
        self._goto: dict[int, int] = {}
        self._depth = [0]  # [nodes]: characters from the root
        self._ends = [-1]  # [nodes]: the stop string (index) the node spells in full, -1 if none
        by_depth: list[list[tuple[int, int, int]]] = []  # edges (parent, code point, child) by the child's depth
        for index, stop in enumerate(self.stops):
            node = 0
            for depth, char in enumerate(stop):
                key = node * _CHARS + ord(char)
                child = self._goto.get(key)
                if child is None:
                    child = self._goto[key] = len(self._depth)
                    self._depth.append(depth + 1)
                    self._ends.append(-1)
                    if len(by_depth) == depth:
                        by_depth.append([])
                    by_depth[depth].append((node, ord(char), child))
                node = child
            self._ends[node] = index
        # Breadth first, so that a node's suffix link and its shorter nodes are known before it is reached.
        self._fail = [0] * len(self._depth)  # [nodes]: the longest proper suffix of the node that is a node
        self._match = [-1] * len(self._depth)  # [nodes]: the longest stop string the node's text ends with
        for edges in by_depth:
            for parent, code, child in edges:
                fail = 0
                if parent:
                    fail = self._fail[parent]
                    while fail and fail * _CHARS + code not in self._goto:
                        fail = self._fail[fail]
                    fail = self._goto.get(fail * _CHARS + code, 0)
                self._fail[child] = fail
                self._match[child] = self._ends[child] if self._ends[child] >= 0 else self._match[fail]

    def feed(self, text: str) -> str:
        """Text that is safe to emit now; sets `stopped` (and `matched`) when a stop string appears."""
        if not self.stops:
            return text
        goto, fail, match = self._goto, self._fail, self._match
        state = self._state
        for i, char in enumerate(text):
            code = ord(char)
            child = goto.get(state * _CHARS + code)
            while child is None and state:
                state = fail[state]
                child = goto.get(state * _CHARS + code)
            state = child or 0
            if match[state] >= 0:
                self.matched = self.stops[match[state]]
                self.stopped = True
                written = self.pending + text[:i + 1]
                self.pending = ""
                return written[:len(written) - len(self.matched)]
        self._state = state
        written = self.pending + text
        keep = self._depth[state]  # the longest tail that a stop string starts with (never all of one)
        self.pending = written[len(written) - keep:] if keep else ""
        return written[:len(written) - keep]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        self._state = 0
        return out
