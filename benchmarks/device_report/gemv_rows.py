"""The decode GEMVs per token-row count (issue 26): gemv_rows.json (gemv_sweep.py --rows 1,2,5,9,16, FP16) and
gemv_rows_quant.json (the same with --bits 4,8): per bits and shape, the effective TB/s of the kernel the plans launch
for each row count and its time against the 1-row time, beside the issue's targets (H200: W4 >= 3.9 TB/s on qkv,
gate_up and down, W8 and FP16 >= 4.0; 16 rows <= 1.15x one row), which this section shows and does not judge."""

from __future__ import annotations

from .values import as_dict, as_int, dicts, fmt, table
from .results import Results

TB_S_TARGET = {16: 4.0, 8: 4.0, 4: 3.9}  # H200, effective
ROWS_RATIO = 1.15  # 16 rows against one row's time


def by_shape(record: dict) -> dict[str, dict[int, dict]]:
    """{"W4 qkv 12288x4096": {token rows: row}} in the order of the rows."""
    out: dict[str, dict[int, dict]] = {}
    for r in dicts(record.get("rows")):
        bits = as_int(r.get("bits"))
        label = f"{'FP16' if bits == 16 else f'W{bits}'} {r.get('shape', '?')}"
        if (t := as_int(r.get("tokens"))) is not None:
            out.setdefault(label, {})[t] = r
    return out


def section(name: str):
    def fn(res: Results) -> list[str]:
        record = res.records[name]
        shapes = by_shape(record)
        if not shapes:
            return ["*no rows*"]
        counts = sorted({t for rs in shapes.values() for t in rs})
        gpu = as_dict(record.get("environment")).get("gpu", "?")
        lines = [f"Effective TB/s (the weight bytes a launch reads over its time) and x 1-row (the time against the "
                 f"same shape's 1-row time) of the kernel the plans launch for each token-row count, on {gpu}. "
                 f"Targets (issue 26, H200): >= {TB_S_TARGET[16]:g} TB/s FP16 and W8, >= {TB_S_TARGET[4]:g} W4 on qkv, "
                 f"gate_up and down; 16 rows <= {ROWS_RATIO:g}x one row.", ""]
        rows, wrong = [], []
        for label, rs in shapes.items():
            first = next(iter(rs.values()))
            cells = []
            for t in counts:
                r = rs.get(t)
                if r is None:
                    cells.append("—")
                    continue
                mark = "" if r.get("check_ok") is True else " WRONG"
                gb_s = r.get("gb_s")
                cells.append(f"{fmt(None if gb_s is None else gb_s / 1e3, 2)} ({fmt(r.get('vs_1row'), 2, 'x')}){mark}")
                wrong += [r] if mark else []
            rows.append([label, first.get("kernel", "?"), first.get("variant", "?").split(" ")[0], *cells])
        lines += table(["bits shape", "kernel", "file", *(f"{t} rows TB/s (x 1-row)" for t in counts)], rows,
                       right=set(range(3, 3 + len(counts))))
        for line in record.get("skipped") or []:
            lines.append(f"\n- skipped: {line}")
        for r in wrong:
            lines.append(f"\n- WRONG: {r.get('shape')} {r.get('tokens')} rows {r.get('variant')}: rel err "
                         f"{fmt(r.get('check_rel_err'), 6)}")
        return lines

    return fn


SECTIONS = [("gemv_rows.json", "Decode GEMVs per token-row count, FP16 (gemv_rows.json)", section("gemv_rows.json")),
            ("gemv_rows_quant.json", "Decode GEMVs per token-row count, W4 and W8 (gemv_rows_quant.json)",
             section("gemv_rows_quant.json"))]
