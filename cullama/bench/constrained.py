"""`cullama bench --json-schema FILE`: what constrained decoding leaves on a token's latency, against plain decoding,
in one run (issue 27).

For each L, trials alternate plain and constrained (warm-up ones first), each the latency protocol's trial (start,
then L greedy next() calls, each queueing the following step before it waits: bench/latency.py); a token's latency
is the host time from the previous token's arrival to its own. A constrained trial runs under the schema's grammar:
the runner computes each token's mask on the host while the step's forward runs on the device and copies it in
before the sample kernel (engine.py). Its grammar starts over where a document ends (a benchmark ignores EOS: after
the forced EOS the next token begins a new document), so every step of every trial is constrained.

Reported per L: p50 and p99 of both, the constrained / plain ratios, and the host's own time per mask (the grammar's
fill: p50, p99, max), which is what the device would wait for if it were not overlapped. On a GPU the ratios are
what the mask leaves on the critical path (issue 27's target: at most 1.05 at p50 and p99, to be measured on a GPU);
on the CPU the backend is synchronous, nothing overlaps, and the ratio is the whole mask cost beside the CPU's step.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Sequence

import numpy as np

from . import latency as protocol

SCHEMA = "cullama-bench-constrained/1"


class LoopingMask:
    """A grammar's matcher (text/grammar.py) whose document starts over once it ended, timing each fill."""

    def __init__(self, matcher, clock=time.perf_counter_ns):
        self.matcher, self.clock = matcher, clock
        self.fill_ns: list[int] = []
        self.documents = 0  # documents completed

    def accept(self, token: int) -> None:
        if self.matcher.stopped:  # the token is the EOS the grammar forced: a new document begins
            self.matcher.reset()
            self.documents += 1
        else:
            self.matcher.accept(token)

    def fill(self, out) -> None:
        start = self.clock()
        self.matcher.fill(out)
        self.fill_ns.append(self.clock() - start)

    def valid_prefix(self, tokens):
        return self.matcher.valid_prefix(tokens)

    def fill_drafts(self, drafts, out):
        self.matcher.fill_drafts(drafts, out)


def summary(ns: Sequence[int]) -> dict:
    ms = np.asarray(ns, np.float64) / 1e6
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99), "max_ms": float(ms.max()),
            "mean_ms": float(ms.mean()), "tokens_per_s": float(1e3 / ms.mean())}


def run(runner, grammars, constraint, lengths: Sequence[int], samples: int, warmup: int, prompt_len: int,
        vocab_size: int, progress=None, clock=time.perf_counter_ns) -> list[dict]:
    """The records, one per L (see the module docstring); `grammars`: the model's (text/grammar.py Grammars)."""
    protocol.check_options(lengths, samples, warmup, prompt_len, runner.max_seq_len)
    prompt = protocol.prompt_ids(prompt_len, vocab_size)
    grammars.check(constraint)  # compiled before any timing
    records = []
    for length in lengths:
        gc.collect()
        trials = math.ceil(samples / length)
        plain, constrained, fills, documents = [], [], [], 0
        for n in range(warmup + trials):
            times = protocol.trial(runner, prompt, length, clock)
            mask = LoopingMask(grammars.matcher(constraint), clock)
            masked = protocol.trial(runner, prompt, length, clock, mask=mask)
            if n >= warmup:
                plain += times
                constrained += masked
                fills += mask.fill_ns
                documents += mask.documents
                if progress:
                    progress(length, "decode", len(plain), trials * length)
        a, b = summary(plain), summary(constrained)
        us = np.asarray(fills, np.float64) / 1e3
        records.append({"length": length, "trials": trials, "plain": a, "constrained": b,
                        "ratio_p50": b["p50_ms"] / a["p50_ms"], "ratio_p99": b["p99_ms"] / a["p99_ms"],
                        "mask_us": {"p50": float(np.percentile(us, 50)), "p99": float(np.percentile(us, 99)),
                                    "max": float(us.max()), "count": int(us.size)},
                        "documents": documents, "plain_ns": plain, "constrained_ns": constrained})
    return records


def format_table(records: list[dict], title: str) -> str:
    lines = [title,
             f"{'L':>5} {'plain p50':>10} {'p99':>8} {'constr p50':>11} {'p99':>8} {'x p50':>7} {'x p99':>7} "
             f"{'mask p50 us':>12} {'p99 us':>8} {'docs':>5}"]
    for r in records:
        a, b, m = r["plain"], r["constrained"], r["mask_us"]
        lines.append(f"{r['length']:>5} {a['p50_ms']:>10.3f} {a['p99_ms']:>8.3f} {b['p50_ms']:>11.3f} "
                     f"{b['p99_ms']:>8.3f} {r['ratio_p50']:>7.3f} {r['ratio_p99']:>7.3f} {m['p50']:>12.1f} "
                     f"{m['p99']:>8.1f} {r['documents']:>5}")
    return "\n".join(lines)
