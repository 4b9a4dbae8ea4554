"""What the runner needs of a constrained generation's grammar: the allowed ids before each token, as the mask rows
the sample kernel reads (kernels_cu/sampling.cu: uint32 words, bit i & 31 of word i >> 5 set = id i allowed).

A runner given a TokenMask (PlanRunner.start / begin, `mask=`) keeps it with the slot's sequence and drives it: before
every step it hands it the last sampled token (`accept`), then has it write the next token's mask (`fill`) into the
slot's mask row while the step's forward runs on the device, and copies the row over before the step's sample
kernel (engine.py). A verify step asks how many of its drafts the grammar allows (`valid_prefix`: the others are
dropped, since none of them could be accepted) and the masks of its rows (`fill_drafts`). cullama/text/grammar.py's
Matcher is one (llguidance); anything with these methods is another.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np


class TokenMask(Protocol):
    def accept(self, token: int) -> None:
        """`token` was sampled (and so follows what was accepted before)."""

    def fill(self, out: np.ndarray) -> None:
        """out (uint32 [words], C-contiguous) = the ids allowed next."""

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` may follow what was accepted (nothing changes)."""

    def fill_drafts(self, drafts: Sequence[int], out: np.ndarray) -> None:
        """out[r] = the ids allowed after the first r drafts, r = 0..len(drafts) (out: uint32 [>= len(drafts) + 1,
        words]); the drafts are a valid prefix, and nothing is accepted."""
