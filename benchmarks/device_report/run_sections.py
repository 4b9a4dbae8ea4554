"""The sections about whole runs: cullama bench (plain and overlapped), the decode step, HuggingFace side by side."""

from __future__ import annotations

from .values import DASH, as_dict, as_int, as_list, change_pct, dicts, fmt, num, ratio, signed, table, tb_s
from .results import Results, bandwidth_of, bench_overlap_flag, bench_results, compare_engines, env_of


def bench_table(record: dict) -> list[str]:
    o = as_dict(record.get("options"))
    bw = bandwidth_of("bench.json", record)
    overlap = o.get("overlap")
    lines = [f"{record.get('model', '?')} on {record.get('device', '?')}, overlap "
             f"{'on' if overlap is True else 'off' if overlap is False else 'not recorded'}; prompt "
             f"{o.get('prompt_len', '?')} tokens, >= {o.get('samples', '?')} decode latencies per L, "
             f"{o.get('warmup', '?')} warm-up trials; TTFT over {o.get('ttft_trials', '?')} prompts of L tokens; "
             f"read bandwidth {tb_s(bw) if bw else 'not measured'}.", ""]
    rows = []
    for r in bench_results(record):
        rows.append([r["length"], r.get("samples", DASH), fmt(r.get("p50_ms")), fmt(r.get("p90_ms")),
                     fmt(r.get("p99_ms")), fmt(r.get("max_ms")), fmt(ratio(r.get("p99_ms"), r.get("p50_ms"))),
                     fmt(r.get("tokens_per_s"), 1), fmt(r.get("gb_s"), 0), fmt(r.get("pct_bandwidth"), 1),
                     fmt(r.get("ttft_p50_ms")), fmt(r.get("ttft_p99_ms"))])
    if not rows:
        return lines + ["*no rows (results is empty)*"]
    return lines + table(["L", "samples", "p50 ms", "p90 ms", "p99 ms", "max ms", "p99/p50", "tok/s", "GB/s",
                          "% read bw", "TTFT p50 ms", "TTFT p99 ms"], rows)


def section_bench(res: Results) -> list[str]:
    return bench_table(res.records["bench.json"])


def section_weights_bench(name: str, target_ms=None):
    """The section of a `cullama bench` record on other weights than the plain 7B's (NAME: --quantize, a family
    preset): its weights, the bytes a step reads and their floor on an H200 (the record's own), then the bench
    table. target_ms(floor) gives the p99 target to show beside them (None: none shown)."""
    def section(res: Results) -> list[str]:
        record = res.records[name]
        w = as_dict(record.get("weights"))
        step_bytes, floor = num(w.get("decode_bytes")), num(w.get("floor_ms_h200"))
        target = f" (target p99 <= {fmt(target_ms(floor) if floor else None)} ms)" if target_ms else ""
        head = (f"Weights: {w.get('weights', 'not recorded')}; a decode step reads "
                f"{fmt(step_bytes / 1e9 if step_bytes else None, 2)} GB, floor {fmt(floor)} ms at 4.44 TB/s"
                f"{target}.")
        return [head, ""] + bench_table(record)
    return section


def section_overlap(res: Results) -> list[str]:
    over = res.records["bench_overlap.json"]
    lines = []
    flag = bench_overlap_flag(over)
    if flag is not True:
        lines.append(f"**Note**: bench_overlap.json ran with overlap {'off' if flag is False else 'not recorded'} "
                     "(options.overlap): no programmatic dependent launch on that device, so this compares "
                     "plain with plain.")
    plain = res.records.get("bench.json")
    if plain is None:
        why = res.problems.get("bench.json", "missing")
        return lines + [f"bench.json {why}: no comparison; bench_overlap.json alone:", ""] + bench_table(over)
    if bench_overlap_flag(plain) is True:
        lines.append("**Note**: bench.json ran with overlap on too (CULLAMA_OVERLAP=1?): this compares overlap "
                     "with overlap.")
    base = {as_int(r["length"]): r for r in bench_results(plain)}
    rows = []
    for r in bench_results(over):
        b = base.get(as_int(r["length"]))
        if b is None:
            continue
        rows.append([r["length"], fmt(b.get("p50_ms")), fmt(r.get("p50_ms")), signed(change_pct(r.get("p50_ms"),
                     b.get("p50_ms"))), fmt(b.get("p99_ms")), fmt(r.get("p99_ms")),
                     signed(change_pct(r.get("p99_ms"), b.get("p99_ms")))])
    only = [r["length"] for r in bench_results(over) if as_int(r["length"]) not in base]
    if lines:
        lines.append("")
    if not rows:
        return lines + [f"*no length in common with bench.json* (overlap lengths: "
                        f"{[r['length'] for r in bench_results(over)]})"]
    lines += table(["L", "plain p50 ms", "overlap p50 ms", "change p50", "plain p99 ms", "overlap p99 ms",
                    "change p99"], rows)
    if only:
        lines += ["", f"Lengths in bench_overlap.json only (not compared): {only}."]
    return lines


def section_decode(res: Results) -> list[str]:
    rec = res.records["decode.json"]
    bw = bandwidth_of("decode.json", rec)
    weight_bytes = num(rec.get("weight_bytes"))
    lines = [f"{rec.get('model', '?')}: {fmt(None if weight_bytes is None else weight_bytes / 1e9, 2)} GB of "
             f"weights per step; floor (weights / read bandwidth {tb_s(bw)}) {fmt(rec.get('floor_ms'))} ms.", ""]
    rows = []
    for r in sorted(dicts(rec.get("rows")), key=lambda r: as_int(r.get("context")) or 0):
        spread = as_list(r.get("graph_spread_ms"))
        rows.append([r.get("context", DASH), r.get("steps", DASH), fmt(r.get("graph_ms")),
                     "-".join(fmt(s) for s in spread) if spread else DASH,
                     fmt(r.get("overlap_ms")) if r.get("overlap_ms") is not None else "n/a",
                     signed(change_pct(r.get("overlap_ms"), r.get("graph_ms"))), fmt(r.get("eager_ms")),
                     fmt(r.get("next_ms")), fmt(r.get("ahead_ms")), signed(change_pct(r.get("ahead_ms"),
                                                                                      r.get("next_ms"))),
                     fmt(r.get("pct_of_floor"), 1, " %")])
    if not rows:
        lines.append("*no rows*")
    else:
        lines += table(["context", "steps", "graph ms", "graph min-max", "overlap ms", "overlap vs graph",
                        "eager ms", "next() ms", "ahead ms", "ahead vs next()", "floor / graph"], rows)
        lines += ["", "graph / overlap / eager: CUDA events over back-to-back steps (median of trials); next() / "
                      "ahead: host clock, token arrival to arrival, plain and with next(ahead=True)."]
    kernels = dicts(rec.get("kernels"))
    if kernels:
        total = sum(num(k.get("us_per_step")) or 0 for k in kernels)
        krows = [[k.get("kernel", "?"), k.get("count", DASH), fmt(k.get("us_each"), 2), fmt(k.get("us_per_step"), 1),
                  fmt(100 * num(k["us_per_step"]) / total if total and num(k.get("us_per_step")) is not None
                      else None, 1, " %"), fmt(k.get("gb_s"), 0),
                  fmt(100 * num(k["gb_s"]) * 1e9 / bw if bw and num(k.get("gb_s")) is not None else None, 1, " %")]
                 for k in kernels]
        lines += ["", "Per kernel inside the graph (event nodes between launches; the context is not recorded in "
                      "decode.json, by default 500):", ""]
        lines += table(["kernel", "launches", "us each", "us / step", "share", "GB/s", "% read bw"], krows)
        lines.append(f"\nSum {fmt(total, 1)} us per step.")
    return lines


def section_compare(res: Results) -> list[str]:
    rec = res.records["compare.json"]
    engines = compare_engines(rec)
    raw = as_dict(rec.get("engines"))
    proto = as_dict(rec.get("protocol"))
    env = env_of(rec)
    lines = [f"Same random LLaMA-2-7B weights, cullama bench's protocol: {proto.get('samples', '?')} latencies per L, "
             f"{proto.get('warmup', '?')} warm-up trial(s); torch {env.get('torch', DASH)}, transformers "
             f"{env.get('transformers', DASH)}."]
    check = as_dict(rec.get("weights_check"))
    if check:
        rel, top1 = num(check.get("logits_max_rel_diff")), num(check.get("top1_agreement"))
        lines.append(f"Prompt logits: max |diff| / max |HF| {fmt(rel, 4)}, top-1 agreement "
                     f"{fmt(None if top1 is None else 100 * top1, 0, ' %')}, "
                     f"HF attention {check.get('attn_implementation', DASH)}"
                     + ("  **WARNING: the engines differ**" if rel is None or rel >= 2e-2 else ""))
    elif "weights_check" not in rec:
        lines.append("No weights check: the HF peers were not set up (torch/transformers missing or failed).")
    for name, r in raw.items():
        r = as_dict(r)
        notes = []
        if "error" in r:
            notes.append(f"FAILED: {r['error']}")
        if "fullgraph" in r:
            notes.append(f"fullgraph={r['fullgraph']}")
        if "skipped" in r:
            notes.append(f"skipped: {r['skipped']}")
        if not engines.get(name):
            notes.append("no lengths measured (skipped over --budget-s, or failed)")
        if notes:
            lines.append(f"- {name}: " + "; ".join(notes))
    lines.append("")
    peers = [n for n in engines if n != "cullama"]
    ours = engines.get("cullama", {})
    lengths = sorted({L for e in engines.values() for L in e} | {as_int(L) for L in as_list(proto.get("lengths"))
                                                                 if as_int(L) is not None})
    rows = []
    for L in lengths:
        o = ours.get(L, {})
        row = [L, fmt(o.get("p50_ms")), fmt(o.get("p99_ms"))]
        for p in peers:
            r = engines[p].get(L, {})
            row += [fmt(r.get("p50_ms")), fmt(r.get("p99_ms")), fmt(ratio(r.get("p50_ms"), o.get("p50_ms")), 2, "x"),
                    fmt(ratio(r.get("p99_ms"), o.get("p99_ms")), 2, "x")]
        rows.append(row)
    if not rows:
        return lines + ["*no lengths measured*"]
    headers = ["L", "cullama p50 ms", "cullama p99 ms"]
    for p in peers:
        headers += [f"{p} p50 ms", f"{p} p99 ms", "x p50", "x p99"]
    return lines + table(headers, rows) + ["", "x = peer / cullama (higher: cullama faster)."]
