"""Stop strings in streamed text: hold back what might still become one, cut at the first that appears.

    matcher = StopMatcher(["\\n\\n", "User:"])
    safe = matcher.feed(piece)    # text that can no longer be part of a stop string
    matcher.stopped, matcher.matched

Every stop string goes into one Aho-Corasick automaton (a trie of the strings with, at each node, a link
to the longest proper suffix of its text that is also a node), built once per generation in time linear in
their total length (a few microseconds a character in Python: the 16 strings of 256 characters a server
request may give take milliseconds). Feeding text walks it one character at a time, so a token costs O(its
characters + the longest stop string) however many stop strings there are: the state's depth is at once
the length of the text to hold back (the longest tail that some stop string starts with) and never more
than the longest stop string, and the first node that completes a stop string ends the text. A stop
string ends the text at the first point where one has been written in full; where several end at that
same character, the longest one counts (it starts earliest).
"""

from __future__ import annotations

from typing import Sequence


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
        # Node 0 is the root (the empty string). The trie's edges by character: rows[code point][node] = the
        # child that spells that character next (one dict per character: small int keys, looked up once).
        rows: dict[int, dict[int, int]] = {}
        depth, ends, parent_of, code_of = [0], [-1], [0], [0]  # [nodes] each; ends: the stop string spelt, or -1
        for index, stop in enumerate(self.stops):
            node = 0
            for char in stop:
                code = ord(char)
                row = rows.setdefault(code, {})
                child = row.get(node)
                if child is None:
                    child = row[node] = len(depth)
                    depth.append(depth[node] + 1)
                    ends.append(-1)
                    parent_of.append(node)
                    code_of.append(code)
                node = child
            ends[node] = index
        # Shallower nodes first, so that a node's suffix link (always shallower) is known before it is needed.
        fail, match = [0] * len(depth), [-1] * len(depth)  # [nodes]: the suffix link; the longest stop ending here
        for node in sorted(range(1, len(depth)), key=depth.__getitem__):
            parent, link = parent_of[node], 0
            if parent:
                row, link = rows[code_of[node]], fail[parent]
                while link and link not in row:
                    link = fail[link]
                link = row.get(link, 0)
            fail[node] = link
            match[node] = ends[node] if ends[node] >= 0 else match[link]
        self._rows, self._depth, self._fail, self._match = rows, depth, fail, match

    def feed(self, text: str) -> str:
        """Text that is safe to emit now; sets `stopped` (and `matched`) when a stop string appears."""
        if not self.stops:
            return text
        rows, fail, match = self._rows, self._fail, self._match
        state = self._state
        for i, char in enumerate(text):
            row = rows.get(ord(char))
            if row is None:  # in no stop string
                state = 0
                continue
            while state and state not in row:
                state = fail[state]
            state = row.get(state, 0)
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
