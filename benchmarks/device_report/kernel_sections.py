"""The sections about kernel choices: prefill pairs and chunks, the GEMV variants, the prefill GEMMs."""

from __future__ import annotations

from .values import DASH, as_int, as_list, dicts, fmt, num, ratio, table, tb_s
from .results import Results, bandwidth_of, checkout_defaults


def combo_of(r: dict) -> tuple:
    """A prefill row's (chunk, gemm, attention, overlap): what a default would be set to."""
    return r.get("chunk"), r.get("gemm"), r.get("attention"), r.get("overlap") is True


def prefill_combos(rec: dict):
    """(rows, combos in order of first appearance, lengths sorted); a combo is combo_of's tuple."""
    rows = [r for r in dicts(rec.get("rows")) if as_int(r.get("length")) is not None]
    combos = []
    for r in rows:
        c = combo_of(r)
        if c not in combos:
            combos.append(c)
    lengths = sorted({as_int(r["length"]) for r in rows})
    return rows, combos, lengths


def combo_name(c) -> str:
    return f"chunk {c[0]} {c[1]}+{c[2]}" + (" overlapped" if c[3] else "")


def prefill_index(rows) -> dict:
    return {(combo_of(r), as_int(r["length"])): r for r in rows}


def wrong_combos(rows) -> set:
    return {combo_of(r) for r in rows if r.get("check_ok") is not True}


def fastest_prefill(rows, length: int, allowed=None):
    """The fastest correct row at `length` (among combos in `allowed`), or None."""
    bad = wrong_combos(rows)
    best = None
    for r in rows:
        c = combo_of(r)
        t = num(r.get("ttft_ms"))
        if as_int(r["length"]) != length or t is None or c in bad or (allowed is not None and c not in allowed):
            continue
        if best is None or t < num(best["ttft_ms"]):
            best = r
    return best


def section_prefill(res: Results) -> list[str]:
    rec = res.records["prefill.json"]
    rows, combos, lengths = prefill_combos(rec)
    if not rows:
        return ["*no rows*"]
    index = prefill_index(rows)
    lines = [f"{rec.get('model', '?')}: TTFT ms (median of runner.start() on the host clock) per prefill chunk, "
             f"kernel pair (GEMM + attention) and prompt length L; check: logits and first token against the "
             f"first row (the default pair at the first chunk). x: WRONG.", ""]
    trows = []
    for c in combos:
        cells = []
        for n in lengths:
            r = index.get((c, n))
            cells.append(DASH if r is None else fmt(r.get("ttft_ms"), 2) + ("" if r.get("check_ok") is True else " x"))
        bad = [n for n in lengths if (c, n) in index and index[(c, n)].get("check_ok") is not True]
        trows.append([c[0], f"{c[1]}+{c[2]}", "on" if c[3] else "off", *cells,
                      "ok" if not bad else f"WRONG at L={','.join(map(str, bad))}"])
    lines += table(["chunk", "pair", "overlap", *[f"L={n}" for n in lengths], "check"], trows,
                   right=set(range(3, 3 + len(lengths))))
    first = rows[0]
    default = combo_of(first)
    brows = []
    for n in lengths:
        best, base = fastest_prefill(rows, n), index.get((default, n))
        if best is None:
            brows.append([n, "no correct pair", DASH, DASH, DASH, DASH])
            continue
        c = combo_of(best)
        brows.append([n, combo_name(c), fmt(best.get("ttft_ms"), 2), fmt(best.get("floor_ms"), 2),
                      fmt(None if base is None else base.get("ttft_ms"), 2),
                      fmt(ratio(None if base is None else base.get("ttft_ms"), best.get("ttft_ms")), 2, "x")])
    lines += ["", "Fastest correct per length:", ""]
    lines += table(["L", "fastest correct", "TTFT ms", "floor ms", f"{combo_name(default)} ms", "speed-up"], brows,
                   right={0, 2, 3, 4, 5})
    wrong = [r for r in rows if r.get("check_ok") is not True]
    for r in wrong:
        lines.append(f"\n- WRONG: chunk {r.get('chunk')} {r.get('gemm')}+{r.get('attention')} L={r.get('length')}: "
                     f"first token {r.get('first_token')}, logits max diff {fmt(r.get('logits_max_diff'), 4)}")
    return lines + prefix_cache_lines(rec)


def prefix_cache_lines(rec: dict) -> list[str]:
    """prefill_step.py's prefix cache rows: each prompt again with its whole chunks in the cache, against the
    whole prefill (the first chunk, the default pair), and whether its first token and logits were bit for bit the
    whole prefill's."""
    cached = [c for c in dicts(rec.get("prefix_cache")) if as_int(c.get("length")) is not None]
    if not cached:
        return []
    crows = [[c["length"], c.get("reused", DASH), fmt(c.get("ttft_ms"), 2), fmt(c.get("fresh_ttft_ms"), 2),
              fmt(ratio(c.get("fresh_ttft_ms"), c.get("ttft_ms")), 2, "x"),
              "yes" if c.get("bit_exact") is True else "NO"] for c in cached]
    lines = ["", "Prefix cache (each prompt again, its whole chunks cached; the default pair at the first chunk):", ""]
    lines += table(["L", "rows reused", "TTFT ms", "whole ms", "speed-up", "bit-exact"], crows, right={0, 1, 2, 3, 4})
    return lines + [f"\n- WRONG: the prefix cache at L={c['length']} is not the whole prefill, bit for bit"
                    for c in cached if c.get("bit_exact") is not True]


def gemv_shapes(rec: dict) -> dict[str, list[dict]]:
    out = {}
    for r in dicts(rec.get("rows")):
        out.setdefault(str(r.get("shape", "?")), []).append(r)
    return out


def gemv_best(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if r.get("check_ok") is True and num(r.get("gb_s")) is not None]
    return max(ok, key=lambda r: num(r["gb_s"])) if ok else None


def gemv_pct(r: dict | None, bw: float | None):
    if r is None:
        return None
    if num(r.get("pct_read_bw")) is not None:
        return r["pct_read_bw"]
    return None if not bw or num(r.get("gb_s")) is None else 100 * num(r["gb_s"]) * 1e9 / bw


def section_gemv(res: Results) -> list[str]:
    rec = res.records["gemv.json"]
    bw = bandwidth_of("gemv.json", rec)
    shapes = gemv_shapes(rec)
    if not shapes:
        return ["*no rows*"]
    default = checkout_defaults().get("gemv_variant")
    rows, wrong = [], []
    for shape, rs in shapes.items():
        best = gemv_best(rs)
        d = next((r for r in rs if r.get("variant") == default), None)
        wrong += [r for r in rs if r.get("check_ok") is not True]
        rows.append([shape, rs[0].get("kernel", "?"), best.get("variant") if best else "no correct variant",
                     fmt(best and best.get("us"), 1), fmt(best and best.get("gb_s"), 0),
                     fmt(gemv_pct(best, bw), 1, " %"),
                     fmt(d and d.get("gb_s"), 0) + ("" if d is None or d.get("check_ok") is True else " (WRONG)"),
                     fmt(gemv_pct(d, bw), 1, " %"), fmt(ratio(best and best.get("gb_s"), d and d.get("gb_s")), 3, "x")])
    lines = [f"GB/s of the FP16 weights per launch (CUDA graph rotating over copies beyond the L2); read bandwidth "
             f"{tb_s(bw)}; default variant {default or 'unknown (cullama not importable)'} (cullama.runtime.plan at "
             f"this checkout: gemv.json does not record it).", ""]
    lines += table(["shape", "kernel", "fastest correct", "us", "GB/s", "% read bw", "default GB/s",
                    "default % bw", "fastest / default"], rows, right=set(range(3, 9)))
    variants = []
    for rs in shapes.values():
        for r in rs:
            if r.get("variant") not in variants:
                variants.append(r.get("variant"))
    grid = []
    for shape, rs in shapes.items():
        by = {r.get("variant"): r for r in rs}
        best = gemv_best(rs)
        grid.append([shape] + [DASH if v not in by else fmt(by[v].get("gb_s"), 0)
                               + ("" if by[v].get("check_ok") is True else " x")
                               + (" *" if by[v] is best else "") for v in variants])
    lines += ["", "GB/s of every variant (* fastest correct, x WRONG):", ""]
    lines += table(["shape", *map(str, variants)], grid)
    for r in wrong:
        lines.append(f"\n- WRONG: {r.get('shape')} {r.get('variant')}: rel err {fmt(r.get('check_rel_err'), 6)}")
    return lines


def gemm_cases(rec: dict):
    """{(shape, M): {kernel: [rows]}} in the order of the rows."""
    cases = {}
    for r in dicts(rec.get("rows")):
        cases.setdefault((str(r.get("shape", "?")), r.get("M")), {}).setdefault(str(r.get("kernel", "?")), []).append(r)
    return cases


def fastest_us(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if r.get("check_ok") is True and num(r.get("us")) is not None]
    return min(ok, key=lambda r: num(r["us"])) if ok else None


def section_gemm(res: Results) -> list[str]:
    rec = res.records["gemm.json"]
    bw = bandwidth_of("gemm.json", rec)
    cases = gemm_cases(rec)
    if not cases:
        return ["*no rows*"]
    kernels = [str(k) for k in as_list(rec.get("kernels"))] or sorted({k for c in cases.values() for k in c})
    rows, wins, plan_agree = [], {k: 0 for k in kernels}, {k: [0, 0] for k in kernels}
    for (shape, M), per in cases.items():
        best_each = {k: fastest_us(rs) for k, rs in per.items()}
        overall = [r for r in best_each.values() if r is not None]
        best = min(overall, key=lambda r: num(r["us"])) if overall else None
        if best is not None:
            wins[best["kernel"]] = wins.get(best["kernel"], 0) + 1
        row = [shape, M, best["kernel"] if best else "no correct kernel", best.get("splits", DASH) if best else DASH,
               fmt(best and best.get("us"), 1), fmt(best and best.get("tflop_s"), 1),
               fmt(best and best.get("pct_read_bw"), 1, " %")]
        for k in kernels:
            b = best_each.get(k)
            plan = next((r for r in per.get(k, []) if r.get("splits") == r.get("plan_splits")), None)
            if b is not None:
                plan_agree.setdefault(k, [0, 0])[1] += 1
                plan_agree[k][0] += b.get("splits") == b.get("plan_splits")
            row += [DASH if b is None else f"S={b.get('splits')} {fmt(b.get('tflop_s'), 1)}",
                    DASH if plan is None else f"S={plan.get('splits')} {fmt(plan.get('tflop_s'), 1)}"
                    + ("" if plan.get("check_ok") is True else " x")]
        rows.append(row)
    lines = [f"Prefill GEMMs (kernels {', '.join(kernels)}; split_k {rec.get('split_k', '?')}); read bandwidth "
             f"{tb_s(bw)}. Per kernel: its fastest correct S and its TFLOP/s, then the plan's S (x: WRONG).", ""]
    headers = ["shape", "M", "fastest", "S", "us", "TFLOP/s", "% read bw"]
    for k in kernels:
        headers += [f"{k} best", f"{k} plan S"]
    lines += table(headers, rows, right={1, 3, 4, 5, 6})
    lines.append("")
    n = len(cases)
    lines.append("Fastest kernel: " + "; ".join(f"{k} in {wins.get(k, 0)} of {n} (shape, M) cases" for k in kernels)
                 + ". The plan's S is its kernel's fastest in: "
                 + "; ".join(f"{k} {a} of {t}" for k, (a, t) in plan_agree.items()) + ".")
    all_rows = dicts(rec.get("rows"))
    wrong = [r for r in all_rows if r.get("check_ok") is not True]
    unchecked = [r for r in all_rows if r.get("check_ok") is True and not r.get("check")]
    for r in wrong:
        lines.append(f"\n- WRONG: {r.get('kernel')} {r.get('shape')} M={r.get('M')} S={r.get('splits')}: "
                     f"{r.get('check') or 'not finite, or a tile counter left non-zero'}")
    if unchecked:
        lines.append(f"\n{len(unchecked)} row(s) (S = 1 at M > 64) were only checked for finite output, not "
                     "against the twin.")
    return lines
