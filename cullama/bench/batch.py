"""`cullama bench --batch 1,2,4,8`: the batched decode step's cost per batch size (issue 17).

For each batch size B: B sequences, each prefilled with its own prompt of prompt_len tokens into its slot, decode
together (runner.set_batch, then runner.batch_step, one captured graph per group size on a GPU); `warmup` steps are
not timed, then `steps` steps are, each to its tokens on the host. Reported per B: the step's p50 / p99 (ms), the
tokens per second of the batch (B / mean step) and of one sequence (1 / mean step), and the step's cost against the
B = 1 step's (the H200 target: at most 1.25x at B = 8). The sequences grow by one token a step, so the contexts run
from prompt_len to prompt_len + warmup + steps.

And for B >= 2, the running streams' gap while a prompt joins (issue 17: within about two decode steps): B - 1
sequences decode while the last slot's prompt of runner.prefill_chunk + 1 tokens starts, as a BatchSession step
runs it: one whole prefill chunk, then the batched step. JOINS such gaps are timed (each a fresh prompt); reported
as join_p50_ms, join_max_ms and join_vs_step (the p50 against this size's step p50), where the prompt fits.
"""

from __future__ import annotations

import time

import numpy as np

from ..common.errors import PromptError
from ..runtime.sampling import SamplingParams

JOINS = 5  # gaps timed per batch size while a prompt joins


def parse_sizes(text: str, max_slots: int) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8); a PromptError naming --batch otherwise."""
    try:
        sizes = tuple(int(p) for p in text.replace(",", " ").split())
    except ValueError:
        raise PromptError(f"--batch {text!r} is not a comma-separated list of integers") from None
    if not sizes or min(sizes) < 1 or max(sizes) > max_slots:
        raise PromptError(f"--batch {text!r}: give one or more batch sizes, each from 1 to {max_slots}")
    return sizes


def check_options(sizes, steps: int, warmup: int, prompt_len: int, context: int) -> None:
    if steps < 1 or warmup < 0 or prompt_len < 1:
        raise PromptError("--samples must be >= 1, --warmup >= 0 and --prompt-len >= 1 with --batch")
    if prompt_len + warmup + steps + JOINS + 1 >= context:
        raise PromptError(f"--batch: --prompt-len {prompt_len} + --warmup {warmup} + --samples {steps} steps (and "
                          f"{JOINS + 1} while a prompt joins) do not fit in the context of {context} tokens")


def run(runner, vocab: int, sizes, steps: int, warmup: int, prompt_len: int, progress=None) -> list[dict]:
    """Each batch size's record: batch, step_ms (every timed step), p50_ms, p99_ms, tokens_per_s,
    sequence_tokens_per_s, vs_batch_1 (the p50 against the first size's, when that is 1), and join_ms (each gap while
    a prompt joins), join_p50_ms, join_max_ms, join_vs_step (None where not measured: B = 1, or no room)."""
    rng = np.random.default_rng(0)
    out = []
    for size in sizes:
        slots = list(range(size))
        for slot in slots:  # greedy: every draw is the same work, and the step does not depend on the tokens
            runner.slot = slot
            runner.start([int(t) for t in rng.integers(3, vocab, prompt_len)], SamplingParams(seed=slot))
        runner.set_batch(slots)
        for _ in range(warmup):
            runner.batch_step()
        ms = []
        for _ in range(steps):
            began = time.perf_counter()
            runner.batch_step()
            ms.append((time.perf_counter() - began) * 1e3)
        p50, p99 = (float(v) for v in np.percentile(ms, [50, 99]))
        mean = float(np.mean(ms))
        joins = join_gaps(runner, vocab, slots, rng)
        out.append({"batch": size, "step_ms": ms, "p50_ms": p50, "p99_ms": p99,
                    "tokens_per_s": size * 1e3 / mean, "sequence_tokens_per_s": 1e3 / mean, "join_ms": joins,
                    "join_p50_ms": float(np.median(joins)) if joins else None,
                    "join_max_ms": max(joins) if joins else None,
                    "join_vs_step": float(np.median(joins)) / p50 if joins else None})
        if progress is not None:
            progress(f"batch {size}: p50 {p50:.3f} ms")
    base = out[0]["p50_ms"] if out and out[0]["batch"] == 1 else None
    for record in out:
        record["vs_batch_1"] = record["p50_ms"] / base if base else None
    return out


def join_gaps(runner, vocab: int, slots: list[int], rng) -> list[float]:
    """ms between two tokens of slots[:-1] while a prompt of one chunk and a token joins in slots[-1]: its first
    chunk, then their batched step (BatchSession.step's order); [] with one slot, or where the prompt does not fit."""
    length = runner.prefill_chunk + 1  # more than a chunk: the first advance() runs a whole one and samples nothing
    if len(slots) < 2 or length >= runner.max_seq_len:
        return []
    running, joining = slots[:-1], slots[-1]
    runner.set_batch(running)
    ms = []
    for _ in range(JOINS + 1):  # the first untimed: the chunk's plan made, the step's graph captured
        runner.slot = joining
        prefill = runner.begin([int(t) for t in rng.integers(3, vocab, length)], SamplingParams())
        began = time.perf_counter()
        prefill.advance()
        runner.batch_step()
        ms.append((time.perf_counter() - began) * 1e3)
    return ms[1:]


def format_table(records: list[dict], title: str) -> str:
    lines = [title, f"{'batch':>5} {'p50 ms':>9} {'p99 ms':>9} {'tok/s':>10} {'tok/s/seq':>10} {'vs B=1':>7} "
                    f"{'join ms':>9} {'join/step':>9}"]
    for r in records:
        vs = f"{r['vs_batch_1']:.2f}x" if r["vs_batch_1"] is not None else "-"
        join, ratio = ((f"{r['join_p50_ms']:.3f}", f"{r['join_vs_step']:.2f}x") if r.get("join_p50_ms") is not None
                       else ("-", "-"))
        lines.append(f"{r['batch']:>5} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} {r['tokens_per_s']:>10.1f} "
                     f"{r['sequence_tokens_per_s']:>10.1f} {vs:>7} {join:>9} {ratio:>9}")
    return "\n".join(lines) + "\n"
