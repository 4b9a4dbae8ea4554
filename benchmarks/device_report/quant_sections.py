"""The quantized kernels (issue 16): W4A16 / W8A16 decode GEMVs (gemv_quant.json: gemv_sweep.py --bits 4,8) and the
prefill GEMM on quantized weights (gemm_quant.json: gemm_sweep.py --kernels mma-w4,mma-w8); their target (each
quantized matrix kernel >= 3.9 TB/s of effective weight bandwidth at the 7B shapes) and the decode variant per
bits."""

from __future__ import annotations

from .values import DASH, dicts, fmt, num, ratio, table, tb_s
from .results import Results, bandwidth_of, unavailable
from .kernel_sections import fastest_us, gemm_cases, gemv_best, gemv_pct, gemv_shapes

QUANT_GEMV_TB_S = 3.9  # issue 16: each quantized matrix kernel, effective weight bandwidth
QUANT_KEEP_WITHIN = 0.01  # keep the default variant where the fastest beats it by no more than 1 %


def quant_shapes(rec: dict) -> dict[str, list[dict]]:
    """{"W4 qkv 12288x4096": rows} in the order of the rows."""
    out = {}
    for r in dicts(rec.get("rows")):
        out.setdefault(f"W{r.get('bits', '?')} {r.get('shape', '?')}", []).append(r)
    return out


def default_variant(bits) -> str | None:
    """The decode variant this checkout's plan launches for `bits` at the LLaMA-2-7B shapes (cullama.runtime.ops.
    gemv_mma.defines; INT4 g128 and INT8 per channel both hold whole k-blocks a group: the KBLOCK_SCALE form)."""
    try:
        from cullama.runtime.ops import gemv_mma

        return " ".join(f"{k}={v}" for k, v in gemv_mma.defines(int(bits), 1, gemv_mma.K_BLOCK_GROUP))
    except Exception:  # noqa: BLE001 - cullama not importable, or bits not 4 / 8: the report says "unknown"
        return None


def fp16_best_us(res: Results, shape: str) -> float | None:
    """The fastest correct FP16 GEMV time on the same shape (gemv.json), for the speedup column."""
    if "gemv.json" not in res.records:
        return None
    best = gemv_best(gemv_shapes(res.records["gemv.json"]).get(shape, []))
    return None if best is None else num(best.get("us"))


def section_gemv_quant(res: Results) -> list[str]:
    rec = res.records["gemv_quant.json"]
    bw = bandwidth_of("gemv_quant.json", rec)
    shapes = quant_shapes(rec)
    if not shapes:
        return ["*no rows*"]
    rows, wrong = [], []
    for label, rs in shapes.items():
        best = gemv_best(rs)
        default = default_variant(rs[0].get("bits"))
        d = next((r for r in rs if r.get("variant") == default), None)
        wrong += [r for r in rs if r.get("check_ok") is not True]
        fp16 = fp16_best_us(res, str(rs[0].get("shape")))
        rows.append([label, rs[0].get("kernel", "?"), best.get("variant") if best else "no correct variant",
                     fmt(best and best.get("us"), 2), fmt(best and best.get("gb_s"), 0),
                     fmt(gemv_pct(best, bw), 1, " %"),
                     fmt(d and d.get("gb_s"), 0) + ("" if d is None or d.get("check_ok") is True else " (WRONG)"),
                     fmt(gemv_pct(d, bw), 1, " %"), fmt(ratio(fp16, best and best.get("us")), 2, "x")])
    lines = [f"Effective GB/s: the bytes a decode step reads per launch (codes and (scale, zero) pairs: INT4 groups "
             f"of 128, INT8 per row), CUDA graph rotating over copies beyond the L2; read bandwidth {tb_s(bw)}; "
             f"default: this checkout's cullama.runtime.ops.gemv_mma.defines; x FP16: the fastest FP16 GEMV on the "
             f"same shape (gemv.json) over this one's time.", ""]
    lines += table(["bits shape", "kernel", "fastest correct", "us", "GB/s", "% read bw", "default GB/s",
                    "default % bw", "x FP16"], rows, right=set(range(3, 9)))
    for label, rs in shapes.items():
        best = gemv_best(rs)
        cells = [f"{r.get('variant')}: {fmt(r.get('gb_s'), 0)}" + ("" if r.get("check_ok") is True else " x")
                 + (" *" if r is best else "") for r in rs]
        lines.append(f"\n- {label}: " + "; ".join(cells))
    for r in wrong:
        lines.append(f"\n- WRONG: W{r.get('bits')} {r.get('shape')} {r.get('variant')}: rel err "
                     f"{fmt(r.get('check_rel_err'), 6)}")
    return lines


def section_gemm_quant(res: Results) -> list[str]:
    rec = res.records["gemm_quant.json"]
    bw = bandwidth_of("gemm_quant.json", rec)
    cases = gemm_cases(rec)
    if not cases:
        return ["*no rows*"]
    fp16 = gemm_cases(res.records["gemm.json"]) if "gemm.json" in res.records else {}
    rows = []
    for (shape, M), per in cases.items():
        base = fastest_us(fp16.get((shape, M), {}).get("mma", []))
        for kernel, rs in per.items():
            b = fastest_us(rs)
            plan = next((r for r in rs if r.get("splits") == r.get("plan_splits")), None)
            rows.append([shape, M, kernel, DASH if b is None else b.get("splits", DASH), fmt(b and b.get("us"), 1),
                         fmt(b and b.get("gb_s"), 0), fmt(b and b.get("pct_read_bw"), 1, " %"),
                         fmt(b and b.get("tflop_s"), 1),
                         DASH if plan is None else f"S={plan.get('splits')} {fmt(plan.get('us'), 1)}"
                         + ("" if plan.get("check_ok") is True else " x"),
                         fmt(ratio(base and base.get("us"), b and b.get("us")), 2, "x")])
    lines = [f"gemm_quant.cu (gemm.cu's tiles and split rule on INT4 / INT8 weights, dequantized into shared memory); "
             f"per kernel, shape and M its fastest correct S; GB/s: effective weight bytes per launch; read bandwidth "
             f"{tb_s(bw)}; x mma: gemm.cu's fastest time on the same case (gemm.json) over this one's.", ""]
    lines += table(["shape", "M", "kernel", "S", "us", "GB/s", "% read bw", "TFLOP/s", "plan S us", "x mma"], rows,
                   right={1, 3, 4, 5, 6, 7, 9})
    return lines


def target_gemv_quant(res: Results):
    """Every W4 / W8 shape's fastest correct variant at or above QUANT_GEMV_TB_S of effective bandwidth."""
    if "gemv_quant.json" not in res.records:
        return None, unavailable(res, "gemv_quant.json")
    shapes = quant_shapes(res.records["gemv_quant.json"])
    if not shapes:
        return None, "no rows in gemv_quant.json"
    best = {s: gemv_best(rs) for s, rs in shapes.items()}
    none = [s for s, b in best.items() if b is None]
    vals = {s: num(b["gb_s"]) / 1e3 for s, b in best.items() if b is not None}
    short = lambda s: " ".join(s.split()[:2])  # noqa: E731 - "W4 qkv"
    low = [s for s, v in vals.items() if v < QUANT_GEMV_TB_S]
    text = ", ".join(f"{short(s)} {v:.2f}" for s, v in vals.items()) + " TB/s"
    if none:
        text += f"; no correct variant: {', '.join(none)}"
    if low:
        text += f"; below {QUANT_GEMV_TB_S}: {', '.join(short(s) for s in low)}"
    return not (none or low), text


TARGETS = [(f"every W4 / W8 GEMV shape >= {QUANT_GEMV_TB_S} TB/s effective (fastest correct variant)",
            "gemv_quant.json", target_gemv_quant)]


def decide_gemv_quant(res: Results) -> str:
    rule = (f"rule: per bits, the variant with the least total time over the shapes (correct on all); the default "
            f"is kept where that beats it by no more than {QUANT_KEEP_WITHIN:.0%}")
    if "gemv_quant.json" not in res.records:
        return f"**Quantized GEMV variant**: no recommendation, {unavailable(res, 'gemv_quant.json')}. {rule}."
    by_bits = {}
    for r in dicts(res.records["gemv_quant.json"].get("rows")):
        by_bits.setdefault(r.get("bits"), []).append(r)
    if not by_bits:
        return f"**Quantized GEMV variant**: no recommendation, gemv_quant.json has no rows. {rule}."
    parts = []
    for bits, rs in by_bits.items():
        shapes = {str(r.get("shape")) for r in rs}
        totals = {}
        for variant in dict.fromkeys(r.get("variant") for r in rs):
            mine = [r for r in rs if r.get("variant") == variant]
            if len(mine) == len(shapes) and all(r.get("check_ok") is True and num(r.get("us")) for r in mine):
                totals[variant] = sum(num(r["us"]) for r in mine)
        default = default_variant(bits)
        if not totals:
            parts.append(f"W{bits}: no variant correct on every shape (fix first)")
            continue
        best = min(totals, key=totals.get)
        gain = ratio(totals.get(default), totals[best])
        if gain is not None and gain <= 1 + QUANT_KEEP_WITHIN:
            parts.append(f"W{bits}: keep {default} ({fmt(totals[default], 1)} us over the shapes"
                         + (f"; {best} {fmt(totals[best], 1)} us" if best != default else "") + ")")
        else:
            parts.append(f"W{bits}: **{best}** ({fmt(totals[best], 1)} us over the shapes; the default {default} "
                         + (f"{fmt(totals[default], 1)} us" if default in totals else "is WRONG or not measured")
                         + ": cullama/runtime/ops/gemv_mma.py defines)")
    return "**Quantized GEMV variant**: " + "; ".join(parts) + f". {rule}."
