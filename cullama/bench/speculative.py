"""`cullama bench --speculative`: speculative decoding's latency as a user sees it, and its verify step's cost.

Batch 1, greedy, EOS ignored, like the plain protocol (cullama/bench/latency.py):
- decode: for each L in `lengths`, trials of start(prompt) then verify steps until L more tokens have
  arrived, drafted by `method`; a token's latency is the host time from the previous token's arrival to
  its own, the tokens of one burst arriving together (the first after the step, the rest 0 behind it).
  Trials repeat until L has `samples` latencies, after `warmup` untimed trials. Reported: p50, p90, p99,
  max and mean, tokens/s, and the timed trials' steps, drafted and accepted tokens, tokens per step.
  `replay` first records the target's greedy continuation of the prompt with a plain run (start, next),
  then drafts it: every draft is accepted, the upper bound on any drafter.
- verify: at `verify_context` tokens of context, the time of one verify() call with k drafts for each
  k in VERIFY_KS and the run's k, against one plain next() (the plain step) in the same run, interleaved
  rep by rep. The drafts are the target's own greedy continuation, so all are accepted (the sequential
  stand-in verify then runs its k + 1 steps); each call starts from the same context again.
- derived, labelled as such: the time per token that the k = 4 verify p50 implies at 1.75 and 2.8 tokens
  per step (Spec-Bench's prompt-lookup averages, overall and summarization), at the tokens per step this
  run measured, and at those `lookup_tokens_per_step` measured with ngram on a real model (stories260K).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Callable, Sequence

import numpy as np

from .latency import GREEDY, Clock, Interrupted, Progress, _num, prompt_ids, record_header, write_record
from ..model.config import LlamaConfig
from ..generation.drafters import Drafter, DraftModel, PromptLookup, Replay
from ..common.errors import PromptError
from ..generation.speculative import MAX_DRAFT, DraftLength, SpeculativeDecoder, SpeculativeStats, verify_step

SCHEMA = "cullama-bench-speculative/1"
METHODS = ("ngram", "draft", "replay")
VERIFY_KS = (1, 2, 4, 8)
DEFAULT_VERIFY_CONTEXT = 500  # the targets are at 500 tokens of context
DEFAULT_VERIFY_REPS = 20
# Spec-Bench (Vicuna-7B, A100, greedy): prompt lookup's mean accepted tokens per step, overall (1.66x) and on
# summarization (2.66x). The derived targets take them at the measured k = 4 verify time.
SPEC_BENCH_TOKENS_PER_STEP = ((1.75, "Spec-Bench prompt lookup, overall"),
                              (2.8, "Spec-Bench prompt lookup, summarization"))


@dataclasses.dataclass
class LengthResult:
    length: int
    decode_ns: list[int]  # trial after trial, L latencies each (0 behind a burst's first token)
    trials: int
    stats: SpeculativeStats  # the timed trials' steps, drafted and accepted tokens

    def summary(self) -> dict:
        ms = np.asarray(self.decode_ns, dtype=np.float64) / 1e6
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        return {"length": self.length, "samples": len(self.decode_ns), "trials": self.trials, "p50_ms": float(p50),
                "p90_ms": float(p90), "p99_ms": float(p99), "max_ms": float(ms.max()), "mean_ms": float(ms.mean()),
                "tokens_per_s": float(1e3 / ms.mean()) if ms.mean() > 0 else None, **self.stats.to_dict()}


@dataclasses.dataclass
class VerifyResult:
    context: int  # cached tokens before each timed call
    times_ns: dict[int, list[int]]  # k -> one verify() call each rep (k = 0: a plain next())
    all_accepted: dict[int, int]  # k -> reps whose k drafts were all accepted

    def rows(self) -> list[dict]:
        plain = float(np.percentile(self.times_ns[0], 50))
        out = []
        for k, ns in sorted(self.times_ns.items()):
            p50 = float(np.percentile(ns, 50))
            out.append({"k": k, "reps": len(ns), "p50_ms": p50 / 1e6, "mean_ms": float(np.mean(ns)) / 1e6,
                        "x_plain": p50 / plain if plain > 0 else None, "all_accepted": self.all_accepted[k]})
        return out

    def p50_ms(self, k: int) -> float:
        return float(np.percentile(self.times_ns[k], 50)) / 1e6


@dataclasses.dataclass
class SpecBenchResult:
    config: LlamaConfig
    device: str
    method: str
    options: dict
    lengths: list[LengthResult]
    verify: VerifyResult | None  # None when Ctrl-C stopped the run before the verify timings
    lookup: dict | None = None  # lookup_tokens_per_step() on a real model, for the derived figures
    interrupted: bool = False  # Ctrl-C stopped the run: `lengths` are those that finished

    def tokens_per_step(self) -> float:
        """Over every timed trial of every length."""
        steps = sum(r.stats.steps for r in self.lengths)
        return (sum(r.stats.accepted for r in self.lengths) + steps) / steps if steps else 0.0

    def derived(self) -> list[dict]:
        """Implied ms per token = the k = 4 verify p50 / tokens per step: derived, not measured (none without
        the verify timings)."""
        if self.verify is None:
            return []
        step_ms = self.verify.p50_ms(4)
        sources = [(tps, label) for tps, label in SPEC_BENCH_TOKENS_PER_STEP]
        sources.append((self.tokens_per_step(), f"{self.method}, k={self.options['draft_tokens']}, measured in this run"))
        if self.lookup:
            sources.append((self.lookup["tokens_per_step"], f"ngram, k={self.lookup['k']}, measured on "
                                                             f"{self.lookup['model']} ({self.lookup['tokens']} tokens)"))
        return [{"source": label, "tokens_per_step": tps, "verify_k4_p50_ms": step_ms,
                 "implied_ms_per_token": step_ms / tps if tps > 0 else None} for tps, label in sources]


# -- options ----------------------------------------------------------------------------------------
def check_options(method: str, draft_tokens: int, max_seq_len: int, verify_context: int, verify_reps: int) -> int:
    """PromptError naming the option; returns the verify context that fits (VERIFY_KS' rows included)."""
    if method not in METHODS:
        raise PromptError(f"--speculative must be one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= MAX_DRAFT:
        raise PromptError(f"--draft-tokens must be from 1 to {MAX_DRAFT}, got {draft_tokens!r}")
    if not isinstance(verify_reps, int) or verify_reps < 1:
        raise PromptError(f"--verify-reps must be an integer >= 1, got {verify_reps!r}")
    room = max_seq_len - MAX_DRAFT - 1  # the longest verify's rows after the context
    if not isinstance(verify_context, int) or verify_context < 1:
        raise PromptError(f"--verify-context must be an integer >= 1, got {verify_context!r}")
    if room < 1:
        raise PromptError(f"the context of {max_seq_len} tokens leaves no room for a verify step of "
                          f"{MAX_DRAFT} drafts (raise --max-seq-len)")
    return min(verify_context, room)


# -- measurements -----------------------------------------------------------------------------------
def greedy_continuation(runner, prompt: Sequence[int], n: int) -> list[int]:
    """The target's first n greedy tokens after `prompt`, by plain decoding (start, then next)."""
    out = [runner.start(prompt, GREEDY)]
    while len(out) < n:
        out.append(runner.next(ahead=len(out) + 1 < n))
    if hasattr(runner, "drain"):
        runner.drain()
    return out


def decode_latencies(runner, make_drafter: Callable[[], Drafter], prompt: Sequence[int], length: int, k: int,
                     samples: int, warmup: int, adaptive: bool = False, clock: Clock = time.perf_counter_ns,
                     progress: Progress | None = None) -> LengthResult:
    """`warmup` + ceil(samples / length) trials of start + `length` more tokens by verify steps."""
    trials = math.ceil(samples / length)
    latencies: list[int] = []
    total = SpeculativeStats(make_drafter().name, k, adaptive)
    for trial in range(warmup + trials):
        decoder = SpeculativeDecoder(runner, make_drafter(), DraftLength(k, adaptive))
        decoder.start(prompt, GREEDY)
        last = clock()  # the prefill's token arrived: the clock starts here, as in the plain protocol
        times: list[int] = []
        while decoder.produced < length + 1:
            burst = decoder.step(length + 1)
            now = clock()
            times += [now - last] + [0] * (len(burst) - 1)  # a burst's tokens arrive together
            last = now
        if trial >= warmup:
            latencies += times
            for field in ("steps", "drafted", "accepted"):
                setattr(total, field, getattr(total, field) + getattr(decoder.stats, field))
            if progress:
                progress(length, "decode", len(latencies), trials * length)
    return LengthResult(length, latencies, trials, total)


def verify_times(runner, vocab_size: int, context: int, ks: Sequence[int], reps: int, warmup: int,
                 clock: Clock = time.perf_counter_ns, progress: Progress | None = None) -> VerifyResult:
    """One verify() call per k per rep at `context` cached tokens, and one plain next() (k = 0)."""
    verify, _ = verify_step(runner)
    prompt = prompt_ids(context, vocab_size, seed=context)
    continuation = greedy_continuation(runner, prompt, max(ks) + 2)  # last, its k drafts, the target's token
    times: dict[int, list[int]] = {k: [] for k in (0, *ks)}
    all_accepted = {k: 0 for k in times}
    for rep in range(warmup + reps):
        for k in times:
            runner.start(prompt, GREEDY, reuse=True)  # back to `context`: only the prompt's last row is recomputed
            t0 = clock()
            out = [runner.next()] if k == 0 else verify(continuation[1:k + 1])
            t1 = clock()
            if rep >= warmup:
                times[k].append(t1 - t0)
                all_accepted[k] += out == continuation[1:k + 2]
        if progress and rep >= warmup:
            progress(context, "verify", rep + 1 - warmup, reps)
    return VerifyResult(context, times, all_accepted)


def lookup_tokens_per_step(runner, bos_id: int, k: int = 4, tokens: int = 256) -> dict:
    """Tokens per step of ngram drafting over `tokens` greedy tokens from BOS (a real model's text)."""
    decoder = SpeculativeDecoder(runner, PromptLookup(), DraftLength(k))
    decoder.start([bos_id], GREEDY)
    while decoder.produced < tokens:
        decoder.step(tokens)
    return {"k": k, "tokens": tokens, **decoder.stats.to_dict()}


def run(runner, config: LlamaConfig, method: str, lengths: Sequence[int], samples: int, warmup: int,
        prompt_len: int, draft_tokens: int = 4, adaptive: bool = False, draft_runner=None,
        verify_context: int = DEFAULT_VERIFY_CONTEXT, verify_reps: int = DEFAULT_VERIFY_REPS, device: str = "cpu",
        lookup: dict | None = None, progress: Progress | None = None, clock: Clock = time.perf_counter_ns,
        extra_options: dict | None = None) -> SpecBenchResult:
    """The whole protocol (see the module docstring) on a runner with start/next (and verify, where it has one)."""
    from .latency import check_options as check_plain

    check_plain(lengths, samples, warmup, prompt_len, runner.max_seq_len)
    context = check_options(method, draft_tokens, runner.max_seq_len, verify_context, verify_reps)
    if method == "draft" and draft_runner is None:
        raise PromptError("--speculative draft needs --draft-model DIR")
    prompt = prompt_ids(prompt_len, config.vocab_size)
    options = {"method": method, "lengths": list(lengths), "samples": samples, "warmup": warmup,
               "prompt_len": prompt_len, "draft_tokens": draft_tokens, "adaptive": adaptive,
               "verify_context": context, "verify_reps": verify_reps, "max_seq_len": runner.max_seq_len,
               "verify": "batched" if hasattr(runner, "verify") else "sequential stand-in (next() calls)",
               **(extra_options or {})}
    results = []
    try:
        for length in lengths:
            if method == "replay":
                script = greedy_continuation(runner, prompt, length + 1)
                make: Callable[[], Drafter] = lambda script=script: Replay(script)
            elif method == "draft":
                make = lambda: DraftModel(draft_runner)
            else:
                make = PromptLookup
            results.append(decode_latencies(runner, make, prompt, length, draft_tokens, samples, warmup, adaptive,
                                            clock, progress))
        ks = sorted({*VERIFY_KS, draft_tokens})
        verify = verify_times(runner, config.vocab_size, context, ks, verify_reps, warmup, clock, progress)
    except KeyboardInterrupt:  # the lengths that finished are kept (the verify timings only once all of them ran)
        raise Interrupted(SpecBenchResult(config, device, method, options, results, None, lookup,
                                          interrupted=True)) from None
    return SpecBenchResult(config, device, method, options, results, verify, lookup)


# -- reports ----------------------------------------------------------------------------------------
def to_json(result: SpecBenchResult, model: str | None = None) -> dict:
    """Every sample, the summaries, the verify times and the derived figures, with the environment."""
    return {
        **record_header(SCHEMA, result.device, model or result.config.name, result.config, result.options),
        "interrupted": result.interrupted,  # then "results" holds the lengths that finished, and "verify" is null
        "results": [{**r.summary(), "decode_ns": r.decode_ns} for r in result.lengths],
        "verify": None if result.verify is None else {
            "context": result.verify.context, "rows": result.verify.rows(),
            "times_ns": {str(k): ns for k, ns in result.verify.times_ns.items()}},
        "lookup": result.lookup,
        "derived": result.derived(),
    }


def write_json(result: SpecBenchResult, path: str | os.PathLike, model: str | None = None) -> None:
    write_record(to_json(result, model), path)


def format_report(result: SpecBenchResult, title: str | None = None) -> str:
    o = result.options
    lines = [title or f"cullama bench --speculative {result.method}: {result.config.name} on {result.device}",
             f"k={o['draft_tokens']}{' (adaptive)' if o['adaptive'] else ''}, prompt {o['prompt_len']} tokens, "
             f">= {o['samples']} token latencies per L, {o['warmup']} warm-up trials; verify: {o['verify']}",
             f"{'L':>5} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} {'mean ms':>8} {'tok/s':>8} "
             f"{'steps':>6} {'tok/step':>8} {'accepted':>13}"]
    for s in (r.summary() for r in result.lengths):
        lines.append(f"{s['length']:>5} {s['p50_ms']:>8.3f} {s['p90_ms']:>8.3f} {s['p99_ms']:>8.3f} {s['max_ms']:>8.3f} "
                     f"{s['mean_ms']:>8.3f} {_num(s['tokens_per_s'], 8, 1)} {s['steps']:>6} {s['tokens_per_step']:>8.2f} "
                     f"{str(s['accepted']) + '/' + str(s['drafted']):>13}")
    if result.verify is None:
        return "\n".join(lines + ["interrupted before the verify step's timings"])
    lines += [f"verify step at {result.verify.context} tokens of context (one verify() call, every draft accepted; "
              f"k=0 is a plain next()):",
              f"{'k':>5} {'p50 ms':>8} {'mean ms':>8} {'x plain':>8} {'accepted':>9}"]
    for row in result.verify.rows():
        lines.append(f"{row['k']:>5} {row['p50_ms']:>8.3f} {row['mean_ms']:>8.3f} {_num(row['x_plain'], 8, 2)} "
                     f"{str(row['all_accepted']) + '/' + str(row['reps']):>9}")
    lines.append("derived, not measured: ms per token = the k=4 verify p50 / tokens per step")
    for d in result.derived():
        implied = "-" if d["implied_ms_per_token"] is None else f"{d['implied_ms_per_token']:.3f} ms/token"
        lines.append(f"  {d['tokens_per_step']:>5.2f} tokens/step ({d['source']}): {implied}")
    return "\n".join(lines)
