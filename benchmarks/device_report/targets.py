"""The issues' targets, each PASS / FAIL / - with the measured value it was judged on."""

from __future__ import annotations

from .values import DASH, as_int, dicts, fmt, num, ratio, table
from .results import Results, bench_results, compare_engines, unavailable
from .kernel_sections import fastest_prefill, gemv_best, gemv_shapes
from .checks import TARGETS as CHECK_TARGETS
from .speculative import TARGETS as SPECULATIVE_TARGETS
from .quant_sections import TARGETS as QUANT_TARGETS
from .families import TARGETS as FAMILY_TARGETS
from .batching import TARGETS as BATCH_TARGETS


# The issues' targets (benchmarks/RESULTS.md).
DECODE_P99_MS = 3.3
QUANT_P99_MS = {"bench_int4.json": 1.1, "bench_int8.json": 1.8}  # issue 16: INT4 / INT8 decode p99, every L
P99_OVER_P50 = 1.05
TARGET_LENGTHS = (10, 500)  # "at every L from 10 to 500"
GEMV_TB_S = 3.9
STEP_MS, STEP_CONTEXT = 3.3, 500
TTFT_MS = {10: 5.0, 500: 15.0}
HF_COMPILED, HF_EAGER = "HF static+compile", "HF eager"
PEER_RATIOS = {HF_COMPILED: 1.7, HF_EAGER: 6.0}


def status(ok: bool | None) -> str:
    return DASH if ok is None else "PASS" if ok else "FAIL"


def in_target_range(res: Results, name: str = "bench.json") -> tuple[list[dict], str]:
    rows = [r for r in bench_results(res.records[name])
            if TARGET_LENGTHS[0] <= as_int(r["length"]) <= TARGET_LENGTHS[1]]
    if not rows:
        return rows, ""
    ls = [as_int(r["length"]) for r in rows]
    cover = f"L {min(ls)}-{max(ls)}, {len(ls)} lengths"
    if min(ls) != TARGET_LENGTHS[0] or max(ls) != TARGET_LENGTHS[1]:
        cover += f"; not the whole {TARGET_LENGTHS[0]}-{TARGET_LENGTHS[1]}"
    return rows, cover


def target_decode_p99(res: Results, name: str = "bench.json", limit: float = DECODE_P99_MS):
    if name not in res.records:
        return None, unavailable(res, name)
    rows, cover = in_target_range(res, name)
    if not rows:
        return None, f"no L from {TARGET_LENGTHS[0]} to {TARGET_LENGTHS[1]} in {name}"
    vals = [(num(r.get("p99_ms")), r["length"]) for r in rows]
    if any(v is None for v, _ in vals):
        return None, "p99 missing at L=" + ",".join(str(L) for v, L in vals if v is None)
    worst, at = max(vals)
    over = [L for v, L in vals if v > limit]
    return not over, (f"worst p99 {worst:.3f} ms at L={at} ({cover})"
                      + (f"; above {limit} at L={','.join(map(str, over))}" if over else ""))


def target_p99_p50(res: Results):
    if "bench.json" not in res.records:
        return None, unavailable(res, "bench.json")
    rows, cover = in_target_range(res)
    if not rows:
        return None, f"no L from {TARGET_LENGTHS[0]} to {TARGET_LENGTHS[1]} in bench.json"
    vals = [(ratio(r.get("p99_ms"), r.get("p50_ms")), r["length"]) for r in rows]
    if any(v is None for v, _ in vals):
        return None, "p99 or p50 missing at L=" + ",".join(str(L) for v, L in vals if v is None)
    worst, at = max(vals)
    over = [L for v, L in vals if v > P99_OVER_P50]
    return not over, (f"worst p99/p50 {worst:.3f} at L={at} ({cover})"
                      + (f"; above {P99_OVER_P50} at L={','.join(map(str, over))}" if over else ""))


def target_gemv(res: Results):
    if "gemv.json" not in res.records:
        return None, unavailable(res, "gemv.json")
    shapes = gemv_shapes(res.records["gemv.json"])
    if not shapes:
        return None, "no rows in gemv.json"
    best = {s: gemv_best(rs) for s, rs in shapes.items()}
    none = [s for s, b in best.items() if b is None]
    vals = {s: num(b["gb_s"]) / 1e3 for s, b in best.items() if b is not None}
    low = [s for s, v in vals.items() if v < GEMV_TB_S]
    text = ", ".join(f"{s.split()[0]} {v:.2f}" for s, v in vals.items()) + " TB/s"
    if none:
        text += f"; no correct variant: {', '.join(none)}"
    if low:
        text += f"; below {GEMV_TB_S}: {', '.join(s.split()[0] for s in low)}"
    return not (none or low), text


def target_step(res: Results):
    if "decode.json" not in res.records:
        return None, unavailable(res, "decode.json")
    rows = [r for r in dicts(res.records["decode.json"].get("rows")) if as_int(r.get("context")) is not None]
    if not rows:
        return None, "no rows in decode.json"
    r = min(rows, key=lambda r: (abs(as_int(r["context"]) - STEP_CONTEXT), -as_int(r["context"])))
    times = {k: num(r.get(k)) for k in ("graph_ms", "overlap_ms")}
    known = {k: v for k, v in times.items() if v is not None}
    if not known:
        return None, f"no graph time at context {r['context']}"
    key, best = min(known.items(), key=lambda kv: kv[1])
    where = "" if as_int(r["context"]) == STEP_CONTEXT else f" (the closest to {STEP_CONTEXT} measured)"
    text = (f"{best:.3f} ms ({key.removesuffix('_ms')}) at context {r['context']}{where}; "
            f"graph {fmt(times['graph_ms'])}, "
            f"overlap {fmt(times['overlap_ms']) if r.get('overlap_ms') is not None else 'n/a'}")
    return best <= STEP_MS, text


def target_ttft(res: Results, length: int):
    limit = TTFT_MS[length]
    best_pair = ""
    if "prefill.json" in res.records:
        rows = [r for r in dicts(res.records["prefill.json"].get("rows")) if as_int(r.get("length")) is not None]
        b = fastest_prefill(rows, length)
        if not any(as_int(r["length"]) == length for r in rows):
            best_pair = f"; prefill.json has no L={length}"
        elif b is not None:
            best_pair = (f"; best prefill.json pair {fmt(b.get('ttft_ms'), 2)} ms (chunk {b.get('chunk')} "
                         f"{b.get('gemm')}+{b.get('attention')})")
        else:
            best_pair = f"; prefill.json: no correct pair at L={length}"
    if "bench.json" not in res.records:
        return None, unavailable(res, "bench.json") + best_pair
    row = next((r for r in bench_results(res.records["bench.json"]) if as_int(r["length"]) == length), None)
    if row is None:
        return None, f"bench.json has no L={length} (its TTFT prompt has L tokens)" + best_pair
    v = num(row.get("ttft_p50_ms"))
    if v is None:
        return None, f"bench.json TTFT p50 missing at L={length}" + best_pair
    return v <= limit, f"bench.json TTFT p50 {v:.2f} ms (default kernels){best_pair}"


def target_peer(res: Results, peer: str):
    need = PEER_RATIOS[peer]
    if "compare.json" not in res.records:
        return None, unavailable(res, "compare.json")
    engines = compare_engines(res.records["compare.json"])
    ours, theirs = engines.get("cullama", {}), engines.get(peer, {})
    common = sorted(set(ours) & set(theirs))
    vals = [(ratio(theirs[L].get("p99_ms"), ours[L].get("p99_ms")), L) for L in common]
    vals = [(v, L) for v, L in vals if v is not None]
    if not vals:
        why = "no cullama lengths" if not ours else f"no {peer} lengths" if not theirs else "no common L"
        return None, f"compare.json: {why}"
    worst, at = min(vals)
    low = [L for v, L in vals if v < need]
    return not low, (f"worst {worst:.2f}x at L={at} (L {','.join(str(L) for _, L in vals)})"
                     + (f"; below {need}x at L={','.join(map(str, low))}" if low else ""))


TARGETS = [
    (f"decode p99 <= {DECODE_P99_MS} ms at every L from 10 to 500", "bench.json", target_decode_p99),
    (f"p99 / p50 <= {P99_OVER_P50} at every L from 10 to 500", "bench.json", target_p99_p50),
    (f"every GEMV shape >= {GEMV_TB_S} TB/s (fastest correct variant)", "gemv.json", target_gemv),
    (f"whole 7B decode step <= {STEP_MS} ms at {STEP_CONTEXT} tokens of context (better of graph, overlap)",
     "decode.json", target_step),
    (f"TTFT <= {TTFT_MS[10]:g} ms, 10-token prompt", "bench.json", lambda res: target_ttft(res, 10)),
    (f"TTFT <= {TTFT_MS[500]:g} ms, 500-token prompt", "bench.json", lambda res: target_ttft(res, 500)),
    (f"p99 >= {PEER_RATIOS[HF_COMPILED]}x lower than HF static cache + torch.compile, every L", "compare.json",
     lambda res: target_peer(res, HF_COMPILED)),
    (f"p99 >= {PEER_RATIOS[HF_EAGER]:g}x lower than HF eager, every L", "compare.json",
     lambda res: target_peer(res, HF_EAGER)),
    *[(f"{name[6:10].upper()} decode p99 <= {limit} ms at every L from 10 to 500", name,
       lambda res, name=name, limit=limit: target_decode_p99(res, name, limit)) for name, limit in QUANT_P99_MS.items()],
    *QUANT_TARGETS,
    *SPECULATIVE_TARGETS,
    *CHECK_TARGETS,
    *FAMILY_TARGETS,
    *BATCH_TARGETS,
]


def targets(res: Results) -> list[str]:
    rows = []
    for text, source, fn in TARGETS:
        try:
            ok, measured = fn(res)
        except Exception as exc:  # noqa: BLE001
            ok, measured = None, f"could not evaluate ({type(exc).__name__}: {exc})"
        rows.append([text, source, measured, status(ok)])
    return table(["target", "from", "measured", "status"], rows, right=set())
