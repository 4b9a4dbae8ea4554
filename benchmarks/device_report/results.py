"""Reading a device check's results (results.tgz, a folder of JSON files, or one file) and what each file holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
import json
import os
import tarfile
import zlib

from .values import as_dict, as_int, dicts, num


FILES = {
    "bench.json": "cullama bench",
    "bench_overlap.json": "cullama bench --overlap --lengths 10,100,500",
    "bench_int4.json": "cullama bench --quantize int4 --lengths 10,100,500",
    "bench_int8.json": "cullama bench --quantize int8 --lengths 10,100,500",
    "decode.json": "benchmarks/decode_step.py",
    "prefill.json": "benchmarks/prefill_step.py",
    "gemv.json": "benchmarks/gemv_sweep.py",
    "gemm.json": "benchmarks/gemm_sweep.py",
    "gemv_quant.json": "benchmarks/gemv_sweep.py --bits 4,8",
    "gemm_quant.json": "benchmarks/gemm_sweep.py --kernels mma-w4,mma-w8",
    "compare.json": "benchmarks/compare_hf.py --quick",
    "speculative.json": "cullama bench --speculative replay --draft-tokens 4",
    "serve.json": "benchmarks/serve_latency.py --synthetic llama-2-7b",
    "emu_vs_gpu.json": "pytest -m gpu (tests/runtime/emu/test_emu_vs_gpu.py)",
    "bench_llama3-8b.json": "cullama bench --synthetic llama3-8b",  # device_report/families.py
    "bench_llama3.2-1b.json": "cullama bench --synthetic llama3.2-1b",
    "batch.json": "cullama bench --batch 1,2,4,8,16",  # device_report/batching.py
    "serve_load.json": "benchmarks/serve_load.py --synthetic llama-2-7b",
    "gemv_rows.json": "benchmarks/gemv_sweep.py --rows 1,2,5,9,16",  # device_report/gemv_rows.py
    "gemv_rows_quant.json": "benchmarks/gemv_sweep.py --bits 4,8 --rows 1,2,5,9,16",
}
SIDE_FILES = ("summary.txt", "steps.log")


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


def unavailable(res: Results, name: str) -> str:
    return f"{name} {res.problems.get(name, 'missing')}"


def not_from_a_gpu(res: Results, name: str) -> str | None:
    """Why a target judged on a GPU only cannot be judged from NAME (missing, unreadable, or run elsewhere); None
    when it can."""
    if name not in res.records:
        return unavailable(res, name)
    device = res.records[name].get("device")
    return None if device == "cuda" else f"{name} ran on {device or '?'}, not a GPU"


def missing_note(res: Results, name: str) -> str:
    if name in res.problems:
        return f"*{name} {res.problems[name]}.*"
    return f"*{name} missing: the step ({FILES[name]}) failed or ran out of time; see summary.txt / steps.log.*"


def env_of(record: dict) -> dict:
    return as_dict(record.get("environment"))


def bandwidth_of(name: str, record: dict) -> float | None:
    """The read bandwidth (bytes/s) each step measured for itself (cullama.bench.latency.measure_bandwidth)."""
    if name in ("bench.json", "bench_overlap.json", "compare.json"):
        return num(as_dict(record.get("bandwidth")).get("bytes_per_s"))
    return num(record.get("read_bandwidth_bytes_per_s"))


def bench_results(record: dict) -> list[dict]:
    """bench.json's rows (cullama.bench.latency.to_json: one per L), sorted by L."""
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
        from cullama.runtime import plan

        out["gemv_variant"] = f"ROWS={plan.GEMV_ROWS} UNROLL={plan.GEMV_UNROLL}"
        out["prefill_chunk"] = plan.PREFILL_CHUNK
    except Exception:  # noqa: BLE001 - cullama not importable here: the report says "unknown"
        pass
    try:
        from cullama.runtime.prefill_kernels import PrefillKernels

        default = PrefillKernels()
        out["prefill_pair"] = (default.gemm, default.attention)
    except Exception:  # noqa: BLE001
        pass
    return out
