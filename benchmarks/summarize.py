"""Summarize a device check: the JSON files of benchmarks/device_check.sh as Markdown for RESULTS.md.

    python benchmarks/summarize.py RESULTS [--markdown FILE]

RESULTS is results.tgz, a directory holding the JSON files (or $OUT itself, holding results.tgz), or one of
the JSON files. The files: bench.json (`cullama bench`), bench_overlap.json (`cullama bench --overlap`),
decode.json (decode_step.py), prefill.json (prefill_step.py), gemv.json (gemv_sweep.py), gemm.json
(gemm_sweep.py) and compare.json (compare_hf.py). summary.txt and steps.log beside them are read too when
present (each step's status; nvidia-smi's driver and clocks). Prints one Markdown report, --markdown writes
it too: a header (date, commit, GPU, driver, CUDA runtime, CuPy, NVRTC, read bandwidth), one section per
file, the issues' targets (PASS / FAIL / - where data is missing) and the decisions the data supports, each
with its rule. Any file may be missing, cut short or odd: that is said in the report, never a traceback.
Exit 0 when a report was printed; 2, with one line on stderr, when RESULTS does not exist or holds none of
the files. Nothing here needs a GPU; cullama is imported only for the defaults of this checkout (the GEMV
variant, the prefill kernels and chunk), which the JSON files do not record.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

FILES = {
    "bench.json": "cullama bench",
    "bench_overlap.json": "cullama bench --overlap --lengths 10,100,500",
    "decode.json": "benchmarks/decode_step.py",
    "prefill.json": "benchmarks/prefill_step.py",
    "gemv.json": "benchmarks/gemv_sweep.py",
    "gemm.json": "benchmarks/gemm_sweep.py",
    "compare.json": "benchmarks/compare_hf.py --quick",
}
SIDE_FILES = ("summary.txt", "steps.log")
DASH = "—"

# The issues' targets (benchmarks/RESULTS.md) and the rules of the decisions.
DECODE_P99_MS = 3.3
P99_OVER_P50 = 1.05
TARGET_LENGTHS = (10, 500)  # "at every L from 10 to 500"
GEMV_TB_S = 3.9
STEP_MS, STEP_CONTEXT = 3.3, 500
TTFT_MS = {10: 5.0, 500: 15.0}
HF_COMPILED, HF_EAGER = "HF static+compile", "HF eager"
PEER_RATIOS = {HF_COMPILED: 1.7, HF_EAGER: 6.0}
OVERLAP_GAIN = 0.01  # overlapped graph faster by more than 1 % at every context
PREFILL_LONG, PREFILL_SHORT, PREFILL_SHORT_LOSS = 500, 10, 0.05
GEMV_KEEP_WITHIN = 0.01  # keep the default variant where the fastest beats it by no more than 1 %


# -- values ---------------------------------------------------------------------------------------
def num(x) -> float | None:
    """A finite number as float; None for None, NaN, inf, strings, booleans, anything else."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def fmt(x, digits: int = 3, suffix: str = "") -> str:
    v = num(x)
    return DASH if v is None else f"{v:.{digits}f}{suffix}"


def signed(x, digits: int = 1, suffix: str = " %") -> str:
    v = num(x)
    return DASH if v is None else f"{v:+.{digits}f}{suffix}"


def change_pct(new, old) -> float | None:
    new, old = num(new), num(old)
    return None if new is None or old is None or old == 0 else 100 * (new - old) / old


def ratio(a, b) -> float | None:
    a, b = num(a), num(b)
    return None if a is None or b is None or b == 0 else a / b


def tb_s(bytes_per_s) -> str:
    return fmt(None if num(bytes_per_s) is None else num(bytes_per_s) / 1e12, 2, " TB/s")


def cuda_version(v) -> str:
    """12080 -> '12.8 (12080)', as cudaDriverGetVersion / cudaRuntimeGetVersion report it."""
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return f"{v // 1000}.{v % 1000 // 10} ({v})"
    return DASH if v is None else str(v)


def as_dict(x) -> dict:
    return x if isinstance(x, dict) else {}


def as_list(x) -> list:
    return x if isinstance(x, list) else []


def dicts(x) -> list[dict]:
    return [r for r in as_list(x) if isinstance(r, dict)]


def as_int(x) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    if isinstance(x, str):
        try:
            return int(x)
        except ValueError:
            return None
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return None


def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(headers: list[str], rows: list[list], right: set[int] | None = None) -> list[str]:
    """A Markdown table; columns in `right` (default: all but the first) are right-aligned."""
    right = set(range(1, len(headers))) if right is None else right
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |",
             "| " + " | ".join("---:" if i in right else "---" for i in range(len(headers))) + " |"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


# -- loading --------------------------------------------------------------------------------------
@dataclass
class Results:
    source: str
    records: dict = field(default_factory=dict)  # name -> the JSON object
    problems: dict = field(default_factory=dict)  # name -> why it could not be read
    mtimes: dict = field(default_factory=dict)  # name -> file time (s since the epoch)
    side: dict = field(default_factory=dict)  # summary.txt / steps.log -> text
    archive_note: str | None = None

    def present(self) -> bool:
        return bool(self.records or self.problems)


def parse(results: Results, name: str, data: bytes) -> None:
    if not data.strip():
        results.problems[name] = "unreadable (empty file)"
        return
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        results.problems[name] = f"unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}; cut short?)"
        return
    if not isinstance(record, dict):
        results.problems[name] = f"unreadable (a JSON {type(record).__name__}, not an object)"
        return
    results.records[name] = record


def read_side_files(results: Results, directory: Path) -> None:
    for name in SIDE_FILES:
        path = directory / name
        try:
            if path.is_file():
                results.side[name] = path.read_text(errors="replace")
        except OSError:
            pass


def load_tgz(path: Path, results: Results) -> None:
    """The JSON files of a tar.gz, member by member: a cut archive still gives the members before the cut."""
    current = None
    try:
        with tarfile.open(path, "r|gz") as archive:
            for member in archive:
                name = os.path.basename(member.name)
                if name not in FILES or not member.isfile():
                    continue
                current = name
                reader = archive.extractfile(member)
                data = reader.read() if reader else b""
                current = None
                results.mtimes[name] = member.mtime
                parse(results, name, data)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        if current is not None:
            results.problems[current] = f"unreadable (the archive is cut inside it: {type(exc).__name__})"
        why = " ".join(str(exc).split())[:160]
        results.archive_note = (f"{path.name} is damaged or not a .tgz ({type(exc).__name__}: {why}); "
                                "what came before the damage is used")


def load(target: str) -> Results:
    """The files under RESULTS (see the module docstring); FileNotFoundError where RESULTS does not exist."""
    path = Path(target)
    if not path.exists():
        raise FileNotFoundError(target)
    results = Results(source=str(path))
    if path.is_dir():
        for name in FILES:
            p = path / name
            if p.is_file():
                try:
                    data = p.read_bytes()
                    results.mtimes[name] = p.stat().st_mtime
                except OSError as exc:
                    results.problems[name] = f"unreadable ({type(exc).__name__}: {exc})"
                    continue
                parse(results, name, data)
        if not results.present() and (path / "results.tgz").is_file():  # $OUT as the device tool returns it
            results.source = str(path / "results.tgz")
            load_tgz(path / "results.tgz", results)
        read_side_files(results, path)
    elif path.name in FILES:
        parse(results, path.name, path.read_bytes())
        results.mtimes[path.name] = path.stat().st_mtime
        read_side_files(results, path.parent)
    else:
        load_tgz(path, results)
        read_side_files(results, path.parent)
    results.records = {n: results.records[n] for n in FILES if n in results.records}  # the same order from anywhere
    return results


# -- what each file holds (the schemas of the writers) ----------------------------------------------
def env_of(record: dict) -> dict:
    return as_dict(record.get("environment"))


def bandwidth_of(name: str, record: dict) -> float | None:
    """The read bandwidth (bytes/s) each step measured for itself (cullama.bench.measure_bandwidth)."""
    if name in ("bench.json", "bench_overlap.json", "compare.json"):
        return num(as_dict(record.get("bandwidth")).get("bytes_per_s"))
    return num(record.get("read_bandwidth_bytes_per_s"))


def bench_results(record: dict) -> list[dict]:
    """bench.json's rows (cullama.bench.to_json: one per L), sorted by L."""
    rows = [r for r in dicts(record.get("results")) if as_int(r.get("length")) is not None]
    return sorted(rows, key=lambda r: as_int(r["length"]))


def bench_overlap_flag(record: dict):
    return as_dict(record.get("options")).get("overlap")


def compare_engines(record: dict) -> dict[str, dict[int, dict]]:
    """compare.json's engines: name -> {L: summary}; JSON turned the int L keys into strings, and the
    same dict holds "error" and "fullgraph"."""
    out = {}
    for name, results in as_dict(record.get("engines")).items():
        out[name] = {as_int(k): v for k, v in as_dict(results).items()
                     if as_int(k) is not None and isinstance(v, dict)}
    return out


def checkout_defaults() -> dict:
    """What this checkout makes default (the JSON files do not say): GEMV variant, prefill kernels, chunk."""
    out = {}
    try:
        from cullama import plan

        out["gemv_variant"] = f"ROWS={plan.GEMV_ROWS} UNROLL={plan.GEMV_UNROLL}"
        out["prefill_chunk"] = plan.PREFILL_CHUNK
    except Exception:  # noqa: BLE001 - cullama not importable here: the report says "unknown"
        pass
    try:
        from cullama.prefill_kernels import PrefillKernels

        default = PrefillKernels()
        out["prefill_pair"] = (default.gemm, default.attention)
    except Exception:  # noqa: BLE001
        pass
    return out


# -- the header -----------------------------------------------------------------------------------
ENV_FIELDS = ("gpu", "compute_capability", "sm_count", "gpu_memory_gib", "l2_mib", "driver", "cuda_runtime",
              "cupy", "nvrtc", "python", "numpy", "sm_clock_mhz", "memory_clock_mhz", "torch", "transformers")


def nvidia_smi(log: str) -> dict:
    """The CSV that device_check.sh has nvidia-smi print at the start of steps.log: {column: value}."""
    lines = log.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("name, driver_version"):
            keys = [k.strip() for k in line.split(",")]
            values = [v.strip() for v in lines[i + 1].split(",")]
            if len(keys) == len(values):
                return dict(zip(keys, values))
    return {}


def steps_summary(text: str) -> str:
    """summary.txt ('install    ok     12s' per step) as one line."""
    parts = []
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2:
            parts.append(" ".join(words))
    return "; ".join(parts)


def header(res: Results) -> list[str]:
    recs = res.records
    dated = [(n, recs[n].get("date")) for n in ("bench.json", "bench_overlap.json")
             if n in recs and isinstance(recs[n].get("date"), str)]
    log = res.side.get("steps.log", "")
    started = next((line.split(",")[0].removeprefix("device_check: ") for line in log.splitlines()
                    if line.startswith("device_check: ")), None)
    if dated:
        date, date_from = dated[0][1], dated[0][0]
    elif started:
        date, date_from = started, "steps.log"
    elif res.mtimes:
        name, t = min(res.mtimes.items(), key=lambda kv: kv[1])
        date = datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")
        date_from = f"{name}'s file time: no JSON with a date"
    else:
        date, date_from = None, "not recorded"
    commits = {n: r.get("commit") for n, r in recs.items() if isinstance(r.get("commit"), str) and r.get("commit")}
    commit = next((c for c in commits.values() if isinstance(c, str) and c), None)
    envs = {n: env_of(r) for n, r in recs.items() if env_of(r)}
    first = {}
    for n, e in envs.items():
        for k in ENV_FIELDS:
            if e.get(k) is not None and k not in first:
                first[k] = (e[k], n)
    gpu = first.get("gpu", (None, None))[0]
    if gpu is None:
        gpu = next((e.get("gpu_status") for e in envs.values() if e.get("gpu_status")), None)
        gpu = f"no GPU ({gpu})" if gpu else "GPU unknown"
    day = date[:10] if isinstance(date, str) else "YYYY-MM-DD"
    lines = [f"## {day} {DASH} {gpu}, commit {commit[:10] if commit else 'unknown'}", ""]
    lines.append(f"- **date**: {date or 'unknown'} ({date_from})")
    if commit:
        others = {n: c for n, c in commits.items() if c != commit}
        lines.append(f"- **commit**: {commit} ({', '.join(commits)}"
                     + (f"; differs in {', '.join(f'{n}: {c}' for n, c in others.items())}" if others else "")
                     + "; dirty or not is not recorded)")
    else:
        lines.append("- **commit**: not recorded")

    def value(k, show=str):
        if k not in first:
            return DASH
        v, _ = first[k]
        differ = sorted({show(e[k]) for e in envs.values() if e.get(k) is not None} - {show(v)})
        return show(v) + (f" (other files: {', '.join(differ)})" if differ else "")

    gpu_bits = [f"cc {value('compute_capability')}", f"{value('sm_count')} SMs", f"{value('gpu_memory_gib')} GiB",
                f"L2 {value('l2_mib')} MiB"] if "gpu" in first else []
    lines.append(f"- **GPU**: {value('gpu') if 'gpu' in first else gpu}"
                 + (f" ({', '.join(gpu_bits)})" if gpu_bits else ""))
    smi = nvidia_smi(log)
    if smi:
        lines.append("- **nvidia-smi** (steps.log): " + ", ".join(f"{k} {v}" for k, v in smi.items()))
    lines.append(f"- **driver** (CUDA version it supports): {value('driver', cuda_version)}"
                 + (f"; driver release {smi['driver_version']} (nvidia-smi)" if "driver_version" in smi else "")
                 + f"; **CUDA runtime** {value('cuda_runtime', cuda_version)}")
    lines.append(f"- **CuPy** {value('cupy')}; **NVRTC** {value('nvrtc')}; Python {value('python')}; "
                 f"NumPy {value('numpy')}" + (f"; torch {value('torch')}, transformers {value('transformers')}"
                                              " (compare.json)" if "torch" in first else ""))
    if "sm_clock_mhz" in first:
        lines.append(f"- **clocks** (device properties): SM {value('sm_clock_mhz')} MHz, memory "
                     f"{value('memory_clock_mhz')} MHz")
    bws = [(n, bandwidth_of(n, r)) for n, r in recs.items()]
    lines.append("- **read bandwidth** (cullama.bench.measure_bandwidth, measured by each step): "
                 + (", ".join(f"{n.removesuffix('.json')} {tb_s(b)}" for n, b in bws) if bws else DASH))
    if "summary.txt" in res.side:
        lines.append(f"- **steps** (summary.txt): {steps_summary(res.side['summary.txt']) or DASH}")
    status = [f"{n} " + ("ok" if n in recs else res.problems.get(n, "missing")) for n in FILES]
    lines.append(f"- **files** ({res.source}): " + "; ".join(status))
    if res.archive_note:
        lines.append(f"- **archive**: {res.archive_note}")
    return lines


# -- one section per file ---------------------------------------------------------------------------
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
    return lines


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
             f"{tb_s(bw)}; default variant {default or 'unknown (cullama not importable)'} (cullama.plan at this "
             f"checkout: gemv.json does not record it).", ""]
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


SECTIONS = [
    ("bench.json", "cullama bench (bench.json)", section_bench),
    ("bench_overlap.json", "Overlap: cullama bench --overlap against bench.json (bench_overlap.json)", section_overlap),
    ("decode.json", "Decode step: plain vs overlapped graph, next() vs ahead (decode.json)", section_decode),
    ("prefill.json", "Prefill: TTFT per kernel pair and chunk (prefill.json)", section_prefill),
    ("gemv.json", "GEMV sweep (gemv.json)", section_gemv),
    ("gemm.json", "GEMM sweep: mma vs wgmma, split-K (gemm.json)", section_gemm),
    ("compare.json", "cullama vs HuggingFace (compare.json)", section_compare),
]


def missing_note(res: Results, name: str) -> str:
    if name in res.problems:
        return f"*{name} {res.problems[name]}.*"
    return f"*{name} missing: the step ({FILES[name]}) failed or ran out of time; see summary.txt / steps.log.*"


def guarded(fn, *args) -> list[str]:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - an odd file is reported, never a traceback
        return [f"*could not summarize: {type(exc).__name__}: {exc} (the file does not have the expected shape)*"]


# -- targets --------------------------------------------------------------------------------------
def status(ok: bool | None) -> str:
    return DASH if ok is None else "PASS" if ok else "FAIL"


def unavailable(res: Results, name: str) -> str:
    return f"{name} {res.problems.get(name, 'missing')}"


def in_target_range(res: Results) -> tuple[list[dict], str]:
    rows = [r for r in bench_results(res.records["bench.json"])
            if TARGET_LENGTHS[0] <= as_int(r["length"]) <= TARGET_LENGTHS[1]]
    if not rows:
        return rows, ""
    ls = [as_int(r["length"]) for r in rows]
    cover = f"L {min(ls)}-{max(ls)}, {len(ls)} lengths"
    if min(ls) != TARGET_LENGTHS[0] or max(ls) != TARGET_LENGTHS[1]:
        cover += f"; not the whole {TARGET_LENGTHS[0]}-{TARGET_LENGTHS[1]}"
    return rows, cover


def target_decode_p99(res: Results):
    if "bench.json" not in res.records:
        return None, unavailable(res, "bench.json")
    rows, cover = in_target_range(res)
    if not rows:
        return None, f"no L from {TARGET_LENGTHS[0]} to {TARGET_LENGTHS[1]} in bench.json"
    vals = [(num(r.get("p99_ms")), r["length"]) for r in rows]
    if any(v is None for v, _ in vals):
        return None, "p99 missing at L=" + ",".join(str(L) for v, L in vals if v is None)
    worst, at = max(vals)
    over = [L for v, L in vals if v > DECODE_P99_MS]
    return not over, (f"worst p99 {worst:.3f} ms at L={at} ({cover})"
                      + (f"; above {DECODE_P99_MS} at L={','.join(map(str, over))}" if over else ""))


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


# -- decisions ------------------------------------------------------------------------------------
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
               else "per shape; the plan has one GEMV_ROWS / GEMV_UNROLL for all today")
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


DECISIONS = [decide_overlap, decide_prefill, decide_gemv, decide_gemm]


def decisions(res: Results) -> list[str]:
    lines = []
    for fn in DECISIONS:
        try:
            lines.append("- " + fn(res))
        except Exception as exc:  # noqa: BLE001
            lines.append(f"- {fn.__name__.removeprefix('decide_')}: could not decide ({type(exc).__name__}: {exc})")
    return lines


# -- the report -----------------------------------------------------------------------------------
def report(res: Results) -> str:
    lines = guarded(header, res)
    for name, title, fn in SECTIONS:
        lines += ["", f"### {title}", ""]
        lines += guarded(fn, res) if name in res.records else [missing_note(res, name)]
    lines += ["", "### Targets", ""] + targets(res)
    lines += ["", "### Decisions", ""] + decisions(res)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", metavar="RESULTS", help="results.tgz, or a directory of the JSON files")
    parser.add_argument("--markdown", metavar="FILE", help="write the report here too")
    args = parser.parse_args(argv)
    try:
        res = load(args.results)
    except FileNotFoundError:
        print(f"summarize: {args.results}: no such file or directory", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"summarize: {args.results}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if not res.present():
        why = f" ({res.archive_note})" if res.archive_note else ""
        print(f"summarize: {args.results} holds none of {', '.join(FILES)}{why}", file=sys.stderr)
        return 2
    text = report(res)
    sys.stdout.write(text)
    if args.markdown:
        try:
            Path(args.markdown).write_text(text)
        except OSError as exc:
            print(f"summarize: could not write {args.markdown}: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
