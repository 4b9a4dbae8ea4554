"""Two checks of the GPU run that are not benchmarks of a kernel: what `cullama serve` adds per token (serve.json,
benchmarks/serve_latency.py; issue 10) and whether the CPU executor agrees with the GPU on the tensor-core kernels
(emu_vs_gpu.json, tests/runtime/emu/test_emu_vs_gpu.py under `pytest -m gpu`; issue 8)."""

from __future__ import annotations

from .values import as_dict, as_int, dicts, fmt, num, table
from .results import Results, not_from_a_gpu, unavailable

SERVE, EMU = "serve.json", "emu_vs_gpu.json"
SERVE_ADDED_MS = 0.2  # the server adds no more than 0.2 ms per token over Llama.stream


def _serve_rows(record: dict) -> list[dict]:
    rows = [r for r in dicts(record.get("rows")) if as_int(r.get("length")) is not None]
    return sorted(rows, key=lambda r: as_int(r["length"]))


def section_serve(res: Results) -> list[str]:
    rec = res.records[SERVE]
    lines = [f"{rec.get('model', '?')} on {rec.get('device', '?')}: ms per token of Llama.stream in the client's "
             "process, of the server's engine (/metrics), and between SSE chunks at a raw HTTP client; added = "
             "client mean - stream mean.", ""]
    rows = []
    for r in _serve_rows(rec):
        s = as_dict(r.get("summary"))
        rows.append([r["length"], fmt(s.get("stream_token_ms_p50")), fmt(s.get("stream_token_ms_mean")),
                     fmt(s.get("engine_token_ms_mean")), fmt(s.get("client_gap_ms_p50")),
                     fmt(s.get("client_gap_ms_p99")), fmt(s.get("client_token_ms_mean")),
                     fmt(s.get("added_ms_per_token")), fmt(s.get("stream_ttft_ms_p50")),
                     fmt(s.get("client_ttft_ms_p50"))])
    if not rows:
        return lines + ["*no rows*"]
    return lines + table(["L", "stream p50", "stream mean", "engine mean", "client p50", "client p99", "client mean",
                          "added", "TTFT stream", "TTFT client"], rows)


def section_emu(res: Results) -> list[str]:
    cases = dicts(res.records[EMU].get("cases"))
    if not cases:
        return ["*no cases*"]
    rows = [[c.get("case", "?"), fmt(c.get("max_abs_diff"), 7), fmt(c.get("max_diff_over_bound"), 7),
             fmt(c.get("tolerance"), 5)] for c in cases]
    return (["The same inputs through the CPU executor and the GPU (the difference over its bound: the sum of "
             "|products| for the GEMMs, max(|out|, 1) for attention).", ""]
            + table(["case", "max |diff|", "diff / bound", "tolerance"], rows))


def target_serve(res: Results):
    if why := not_from_a_gpu(res, SERVE):
        return None, why
    rec = res.records[SERVE]
    vals = [(num(as_dict(r.get("summary")).get("added_ms_per_token")), r["length"]) for r in _serve_rows(rec)]
    if not vals or any(v is None for v, _ in vals):
        return None, "added ms per token missing"
    worst, at = max(vals)
    return worst <= SERVE_ADDED_MS, f"worst {worst:.3f} ms added per token at L={at}"


def target_emu(res: Results):
    if EMU not in res.records:
        return None, unavailable(res, EMU)
    cases = dicts(res.records[EMU].get("cases"))
    ratios = [(num(c.get("max_diff_over_bound")), num(c.get("tolerance")), c.get("case", "?")) for c in cases]
    ratios = [r for r in ratios if r[0] is not None and r[1] is not None]
    if not ratios:
        return None, "no cases recorded"
    off = [name for v, tol, name in ratios if v > tol]
    worst = max(ratios, key=lambda r: r[0] / r[1])
    return not off, (f"{len(ratios)} cases; worst {worst[0]:.3g} of the bound ({worst[2]})"
                     + (f"; beyond tolerance: {', '.join(off)}" if off else ""))


TARGETS = [
    (f"cullama serve adds <= {SERVE_ADDED_MS} ms per token over Llama.stream", SERVE, target_serve),
    ("the CPU executor agrees with the GPU on mma.sync, ldmatrix and wgmma", EMU, target_emu),
]
SECTIONS = [
    (SERVE, "Serving: what cullama serve adds per token (serve.json)", section_serve),
    (EMU, f"The CPU executor against the GPU ({EMU})", section_emu),
]
