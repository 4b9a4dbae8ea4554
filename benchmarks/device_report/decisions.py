"""The decisions on defaults that the data supports (overlap, prefill kernels and chunk, GEMV variant, prefill
GEMM, quantized GEMV variant), each with its rule."""

from __future__ import annotations

from .values import as_dict, as_int, change_pct, dicts, fmt, num, ratio
from .results import Results, bench_overlap_flag, bench_results, checkout_defaults, unavailable
from .quant_sections import decide_gemv_quant
from .kernel_sections import (combo_name, combo_of, fastest_us, gemm_cases, gemv_best, gemv_shapes, prefill_combos,
                              prefill_index, wrong_combos)


# The rules of the decisions.
OVERLAP_GAIN = 0.01  # overlapped graph faster by more than 1 % at every context
PREFILL_LONG, PREFILL_SHORT, PREFILL_SHORT_LOSS = 500, 10, 0.05
GEMV_KEEP_WITHIN = 0.01  # keep the default variant where the fastest beats it by no more than 1 %


def decide_overlap(res: Results) -> str:
    rule = (f"rule: on if the overlapped graph is faster by more than {OVERLAP_GAIN:.0%} at every context of "
            "decode.json and bench_overlap.json's p99 is not worse than bench.json's at any common L; else off")
    parts, verdicts, missing = [], [], []
    if "decode.json" in res.records:
        rows = [r for r in dicts(res.records["decode.json"].get("rows")) if r.get("context") is not None]
        if not rows:
            missing.append("decode.json has no rows")
        elif any(r.get("overlap_ms") is None for r in rows):
            verdicts.append(False)
            parts.append("decode.json has no overlapped time (no programmatic dependent launch before sm_90)")
        else:
            changes = [(change_pct(r.get("overlap_ms"), r.get("graph_ms")), r.get("context")) for r in rows]
            if any(c is None for c, _ in changes):
                missing.append("decode.json has a graph or overlap time missing")
            else:
                ok = all(c < -100 * OVERLAP_GAIN for c, _ in changes)
                verdicts.append(ok)
                parts.append("overlapped graph vs plain: " + ", ".join(f"{c:+.1f} % at context {n}" for c, n in changes)
                             + (" (faster by more than 1 % everywhere)" if ok else " (not faster by more than 1 % "
                                                                                  "everywhere)"))
    else:
        missing.append(unavailable(res, "decode.json"))
    if "bench_overlap.json" in res.records and "bench.json" in res.records:
        over, plain = res.records["bench_overlap.json"], res.records["bench.json"]
        if bench_overlap_flag(over) is not True or bench_overlap_flag(plain) is True:
            missing.append("bench_overlap.json did not run overlapped against a plain bench.json (options.overlap)")
        else:
            base = {as_int(r["length"]): r for r in bench_results(plain)}
            pairs = [(num(r.get("p99_ms")), num(base[as_int(r["length"])].get("p99_ms")), r["length"])
                     for r in bench_results(over) if as_int(r["length"]) in base]
            pairs = [p for p in pairs if p[0] is not None and p[1] is not None]
            if not pairs:
                missing.append("no common L with p99 in bench.json and bench_overlap.json")
            else:
                worse = [L for o, p, L in pairs if o > p]
                verdicts.append(not worse)
                parts.append("bench_overlap p99 " + ("not worse at any L" if not worse
                                                     else f"worse at L={','.join(map(str, worse))}"))
    else:
        missing += [unavailable(res, n) for n in ("bench.json", "bench_overlap.json") if n not in res.records]
    if False in verdicts:
        also = f"; besides, {'; '.join(missing)}" if missing else ""
        return f"**Overlap**: keep it **off** by default ({'; '.join(parts)}{also}). {rule}."
    if missing:
        return (f"**Overlap**: no recommendation, data missing ({'; '.join(missing)})"
                + (f"; what there is: {'; '.join(parts)}" if parts else "") + f". {rule}.")
    return f"**Overlap**: turn it **on** by default ({'; '.join(parts)}). {rule}."


def closest(lengths: list[int], want: int) -> int | None:
    return min(lengths, key=lambda n: (abs(n - want), -n)) if lengths else None


def decide_prefill(res: Results) -> str:
    rule = (f"rule: the fastest correct (chunk, pair) at L={PREFILL_LONG}, unless its TTFT at L={PREFILL_SHORT} is "
            f"more than {PREFILL_SHORT_LOSS:.0%} above the fastest correct there (then the next at L={PREFILL_LONG}); "
            "a WRONG check at any length disqualifies the chunk and pair")
    if "prefill.json" not in res.records:
        return f"**Prefill kernels and chunk**: no recommendation, {unavailable(res, 'prefill.json')}. {rule}."
    rows, combos, lengths = prefill_combos(res.records["prefill.json"])
    if not rows:
        return f"**Prefill kernels and chunk**: no recommendation, prefill.json has no rows. {rule}."
    long_, short = closest(lengths, PREFILL_LONG), closest(lengths, PREFILL_SHORT)
    if long_ == short:
        return (f"**Prefill kernels and chunk**: no recommendation, prefill.json's lengths {lengths} give L={long_} "
                f"for both the long and the short prompt. {rule}.")
    notes = []
    if long_ != PREFILL_LONG or short != PREFILL_SHORT:
        notes.append(f"L={PREFILL_LONG} / {PREFILL_SHORT} not both measured: used L={long_} / {short}")
    bad = wrong_combos(rows)
    if bad:
        notes.append("disqualified (WRONG): " + ", ".join(combo_name(c) for c in combos if c in bad))
    index = prefill_index(rows)
    good = [c for c in combos if c not in bad and num(as_dict(index.get((c, long_))).get("ttft_ms")) is not None
            and num(as_dict(index.get((c, short))).get("ttft_ms")) is not None]
    if not good:
        return (f"**Prefill kernels and chunk**: no correct (chunk, pair) measured at both L={long_} and L={short}: "
                f"keep the default and look at the WRONG rows{'; ' + '; '.join(notes) if notes else ''}. {rule}.")
    best_short = min(num(index[(c, short)]["ttft_ms"]) for c in good)
    ranked = sorted(good, key=lambda c: num(index[(c, long_)]["ttft_ms"]))
    limit = (1 + PREFILL_SHORT_LOSS) * best_short
    choice = next((c for c in ranked if num(index[(c, short)]["ttft_ms"]) <= limit), None)
    skipped = ranked[:ranked.index(choice)] if choice else ranked
    if skipped:
        notes.append("passed over (more than 5 % slower at the short prompt): "
                     + ", ".join(f"{combo_name(c)} ({num(index[(c, short)]['ttft_ms']) / best_short - 1:+.0%})"
                                 for c in skipped))
    t_long, t_short = num(index[(choice, long_)]["ttft_ms"]), num(index[(choice, short)]["ttft_ms"])
    defaults = checkout_defaults()
    current = (defaults.get("prefill_chunk"), *defaults.get("prefill_pair", (None, None)), False)
    if None in current:
        current = combo_of(rows[0])
    cur = [num(as_dict(index.get((current, n))).get("ttft_ms")) for n in (long_, short)]
    vs = (f"; the current default {combo_name(current)}: "
          + (f"{fmt(cur[0], 2)} / {fmt(cur[1], 2)} ms" if None not in cur else "not measured"))
    same = choice == current
    verb = "keep" if same else "make default"
    return (f"**Prefill kernels and chunk**: {verb} GEMM **{choice[1]}**, attention **{choice[2]}**, chunk "
            f"**{choice[0]}**, overlap **{'on' if choice[3] else 'off'}** (TTFT {t_long:.2f} ms at L={long_}, "
            f"{t_short:.2f} ms at L={short}{vs})"
            + (f"; {'; '.join(notes)}" if notes else "") + f". {rule}.")


def decide_gemv(res: Results) -> str:
    rule = (f"rule: per shape the fastest correct variant; the default is kept where that beats it by no more "
            f"than {GEMV_KEEP_WITHIN:.0%}")
    if "gemv.json" not in res.records:
        return f"**GEMV variant**: no recommendation, {unavailable(res, 'gemv.json')}. {rule}."
    shapes = gemv_shapes(res.records["gemv.json"])
    if not shapes:
        return f"**GEMV variant**: no recommendation, gemv.json has no rows. {rule}."
    default = checkout_defaults().get("gemv_variant")
    picks, lines = {}, []
    for shape, rs in shapes.items():
        best = gemv_best(rs)
        d = next((r for r in rs if r.get("variant") == default and r.get("check_ok") is True), None)
        if best is None:
            lines.append(f"{shape}: no correct variant (fix first)")
            continue
        gain = ratio(best.get("gb_s"), d and d.get("gb_s"))
        if d is not None and gain is not None and gain <= 1 + GEMV_KEEP_WITHIN:
            picks[shape] = default
            lines.append(f"{shape}: keep {default}" + (f" (fastest {best['variant']} +{100 * (gain - 1):.1f} %)"
                                                       if best is not d else ""))
        else:
            picks[shape] = best.get("variant")
            lines.append(f"{shape}: {best.get('variant')}" + (f" (+{100 * (gain - 1):.1f} % over the default)"
                                                             if gain is not None else " (the default is WRONG or "
                                                             "not measured)"))
    distinct = set(picks.values())
    one = len(distinct) == 1 and len(picks) == len(shapes)
    summary = ("one variant for every shape, " + next(iter(distinct)) if one
               else "per shape; the plan has one gemv_mma variant per bits for all today")
    return f"**GEMV variant**, {summary}: " + "; ".join(lines) + f". {rule}."


def decide_gemm(res: Results) -> str:
    rule = ("rule: the kernel with the least total time over every (shape, M) case, each at its fastest correct S; "
            "a kernel with no correct S in some case is out; prefill.json's end-to-end TTFT has the last word")
    if "gemm.json" not in res.records:
        return f"**Prefill GEMM**: no recommendation, {unavailable(res, 'gemm.json')}. {rule}."
    cases = gemm_cases(res.records["gemm.json"])
    if not cases:
        return f"**Prefill GEMM**: no recommendation, gemm.json has no rows. {rule}."
    kernels = sorted({k for per in cases.values() for k in per})
    totals, out, wins = {}, [], {k: 0 for k in kernels}
    for k in kernels:
        total = 0.0
        for per in cases.values():
            b = fastest_us(per.get(k, []))
            if b is None:
                out.append(k)
                break
            total += num(b["us"])
        else:
            totals[k] = total
    for per in cases.values():
        best = [fastest_us(rs) for rs in per.values()]
        best = [b for b in best if b is not None]
        if best:
            wins[min(best, key=lambda r: num(r["us"]))["kernel"]] += 1
    text = ", ".join(f"{k} {fmt(totals.get(k), 1, ' us') if k in totals else 'out (no correct S in some case)'}, "
                     f"fastest in {wins[k]} of {len(cases)}" for k in kernels)
    if not totals:
        return f"**Prefill GEMM**: no kernel is correct in every case ({text}). {rule}."
    pick = min(totals, key=totals.get)
    return f"**Prefill GEMM**: **{pick}** (total over the cases: {text}). {rule}."


DECISIONS = [decide_overlap, decide_prefill, decide_gemv, decide_gemm, decide_gemv_quant]


def decisions(res: Results) -> list[str]:
    lines = []
    for fn in DECISIONS:
        try:
            lines.append("- " + fn(res))
        except Exception as exc:  # noqa: BLE001
            lines.append(f"- {fn.__name__.removeprefix('decide_')}: could not decide ({type(exc).__name__}: {exc})")
    return lines
