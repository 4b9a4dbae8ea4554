"""Batched decode (issue 17): `cullama bench --batch` (batch.json: the step per batch size) and
benchmarks/serve_load.py (serve_load.json: concurrency levels through the HTTP server), with the issue's targets:
a B = 8 step at most 1.25x the B = 1 step; at concurrency 8, inter-token p99 at most 1.3x that at concurrency 1 and
at least 6x the tokens per second; while a prompt joins B = 8, the running rows' gap within about two steps (one prefill
chunk and the step: plan.batch_prefill_chunk)."""

from __future__ import annotations

from .values import as_dict, as_int, dicts, fmt, num, ratio, table
from .results import Results, not_from_a_gpu

STEP_RATIO, BATCH = 1.25, 8
GAP_P99_RATIO, TOKENS_RATIO, CONCURRENCY = 1.3, 6.0, 8
JOIN_RATIO = 2.5  # "within about two decode steps": the gap's p50 against the step's, while a prompt joins


def batch_sizes(record: dict) -> dict[int, dict]:
    """batch.json's records by batch size."""
    return {as_int(r.get("batch")): r for r in dicts(record.get("sizes")) if as_int(r.get("batch")) is not None}


def load_levels(record: dict) -> dict[int, dict]:
    """serve_load.json's summaries by concurrency."""
    return {as_int(r.get("concurrency")): as_dict(r.get("summary")) for r in dicts(record.get("rows"))
            if as_int(r.get("concurrency")) is not None}


def section_batch(res: Results) -> list[str]:
    record = res.records["batch.json"]
    o = as_dict(record.get("options"))
    sizes = batch_sizes(record)
    lines = [f"{record.get('model', '?')} on {record.get('device', '?')}, overlap "
             f"{'on' if o.get('overlap') is True else 'off'}, prefill chunk {o.get('prefill_chunk', '?')}; each step "
             "read back to the host. Join: B - 1 rows' gap while a prompt's first chunk runs before their step.", ""]
    rows = [[b, len(r.get("step_ms") or []), fmt(r.get("p50_ms")), fmt(r.get("p99_ms")), fmt(r.get("tokens_per_s"), 1),
             fmt(r.get("sequence_tokens_per_s"), 1), fmt(r.get("vs_batch_1"), 2, "x"), fmt(r.get("join_p50_ms")),
             fmt(r.get("join_max_ms")), fmt(r.get("join_vs_step"), 2, "x")] for b, r in sorted(sizes.items())]
    if not rows:
        return lines + ["*no batch sizes in batch.json*"]
    return lines + table(["B", "steps", "p50 ms", "p99 ms", "tok/s", "tok/s a sequence", "p50 vs B=1", "join p50 ms",
                          "join max ms", "join vs step"], rows)


def section_load(res: Results) -> list[str]:
    record = res.records["serve_load.json"]
    levels = load_levels(record)
    lines = [f"{record.get('model', '?')} on {record.get('device', '?')}, --max-batch {record.get('max_batch', '?')}.",
             ""]
    rows = [[c, fmt(s.get("ttft_ms_p50"), 2), fmt(s.get("ttft_ms_p99"), 2), fmt(s.get("gap_ms_p50"), 2),
             fmt(s.get("gap_ms_p99"), 2), fmt(s.get("tokens_per_s"), 1), fmt(s.get("tokens_per_s_per_client"), 1)]
            for c, s in sorted(levels.items())]
    if not rows:
        return lines + ["*no concurrency levels in serve_load.json*"]
    return lines + table(["C", "TTFT p50 ms", "TTFT p99 ms", "gap p50 ms", "gap p99 ms", "tok/s", "tok/s a client"],
                         rows)


def target_step(res: Results):
    if why := not_from_a_gpu(res, "batch.json"):
        return None, why
    sizes = batch_sizes(res.records["batch.json"])
    if 1 not in sizes or BATCH not in sizes:
        return None, f"batch.json needs B=1 and B={BATCH} (has {sorted(sizes)})"
    r = ratio(sizes[BATCH].get("p50_ms"), sizes[1].get("p50_ms"))
    if r is None:
        return None, "a p50 is missing"
    return r <= STEP_RATIO, f"B={BATCH} p50 {r:.2f}x B=1's ({fmt(sizes[BATCH].get('p50_ms'))} / " \
                            f"{fmt(sizes[1].get('p50_ms'))} ms)"


def target_join(res: Results):
    if why := not_from_a_gpu(res, "batch.json"):
        return None, why
    r = batch_sizes(res.records["batch.json"]).get(BATCH, {})
    if (v := num(r.get("join_vs_step"))) is None:
        return None, f"batch.json has no gap while a prompt joins B={BATCH}"
    return v <= JOIN_RATIO, f"join p50 {v:.2f}x the B={BATCH} step ({fmt(r.get('join_p50_ms'))} / " \
                            f"{fmt(r.get('p50_ms'))} ms)"


def target_load(res: Results, key: str, limit: float, at_most: bool):
    if why := not_from_a_gpu(res, "serve_load.json"):
        return None, why
    levels = load_levels(res.records["serve_load.json"])
    if 1 not in levels or CONCURRENCY not in levels:
        return None, f"serve_load.json needs C=1 and C={CONCURRENCY} (has {sorted(levels)})"
    r = ratio(levels[CONCURRENCY].get(key), levels[1].get(key))
    if r is None:
        return None, f"{key} is missing"
    return (r <= limit if at_most else r >= limit), f"{key} at C={CONCURRENCY} {r:.2f}x C=1's"


SECTIONS = [("batch.json", "Batched decode: cullama bench --batch (batch.json)", section_batch),
            ("serve_load.json", "Many clients: benchmarks/serve_load.py (serve_load.json)", section_load)]
TARGETS = [
    (f"batched step: B={BATCH} p50 <= {STEP_RATIO}x B=1", "batch.json", target_step),
    (f"a prompt joining B={BATCH}: gap p50 <= {JOIN_RATIO}x the step", "batch.json", target_join),
    (f"serve at C={CONCURRENCY}: inter-token p99 <= {GAP_P99_RATIO}x C=1", "serve_load.json",
     lambda res: target_load(res, "gap_ms_p99", GAP_P99_RATIO, True)),
    (f"serve at C={CONCURRENCY}: tokens/s >= {TOKENS_RATIO:g}x C=1", "serve_load.json",
     lambda res: target_load(res, "tokens_per_s", TOKENS_RATIO, False)),
]
