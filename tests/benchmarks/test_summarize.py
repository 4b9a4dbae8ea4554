"""benchmarks/summarize.py on real JSON files: the benchmark scripts run under the fake GPU exactly as in
test_benchmark_scripts.py (its `fake` fixture), `cullama bench --device cpu` writes bench.json and
bench_overlap.json, and compare.json is built as compare_hf.py writes it (torch is not installed here). Then
edited copies: the targets and the decisions flip where the rules say, and a missing, cut or odd file is a note
in the report, never a traceback."""

import copy
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tests import fake_cupy
from cullama.bench import latency as bench
from cullama.runtime import plan
from cullama.cli.main import main as cli
from cullama.model.config import preset
from cullama.runtime.device import environment
from tests.benchmarks.test_benchmark_scripts import BENCHMARKS, DECODE_ARGS, run_main
from tests.benchmarks.test_benchmark_scripts import fake as fake  # noqa: F401 - the fixture

import gemv_sweep  # noqa: E402
import summarize  # noqa: E402 - benchmarks/ is on sys.path (test_benchmark_scripts puts it there)

NAMES = list(summarize.FILES)
TINY = preset("tiny")
DEFAULT_VARIANT, OTHER_VARIANT = (" ".join(f"{k}={v}" for k, v in d) for d in gemv_sweep.SWEEP[16])  # the plan's first
_MADE = {}


def bench_json(path: Path, *extra: str) -> None:
    result = CliRunner().invoke(cli, ["bench", "--device", "cpu", "--lengths", "10,20", "--samples", "10",
                                      "--warmup", "0", "--prompt-len", "2", "--json", str(path), *extra])
    assert result.exit_code == 0, result.output


def speculative_json(path: Path) -> None:
    result = CliRunner().invoke(cli, ["bench", "--device", "cpu", "--speculative", "replay", "--draft-tokens", "4",
                                      "--lengths", "10,20", "--samples", "10", "--warmup", "0", "--prompt-len", "2",
                                      "--verify-context", "30", "--verify-reps", "2", "--json", str(path)])
    assert result.exit_code == 0, result.output


def compare_json(path: Path) -> None:
    """A record with compare_hf.py's layout (main() and hf_peers()): cullama bench's summaries per engine and L,
    the int L keys as json.dump turns them into strings, "fullgraph" beside them; latencies made up."""
    bandwidth = {"bytes_per_s": 4.4e12, "buffer_bytes": 1 << 30, "reps_s": [0.001], "statistic": "best of reps",
                 "kernel": "bandwidth.cu:read_sum"}
    lengths, samples = (10, 100, 500), 20
    record = {"protocol": {"lengths": list(lengths), "samples": samples, "warmup": 1,
                           "prompt": bench.prompt_ids(8, 32000)},
              "bandwidth": bandwidth, "environment": environment(), "engines": {}}
    record["environment"].update(torch="2.9.0", transformers="4.57.0")
    record["weights_check"] = {"logits_max_rel_diff": 3e-3, "top1_agreement": 0.97, "attn_implementation": "sdpa"}
    rng = np.random.default_rng(1)
    for name, ms in (("cullama", 3.0), ("HF eager", 24.0), ("HF static+compile", 6.0)):
        results = record["engines"][name] = {}
        for L in lengths:
            ns = (rng.uniform(1.0, 1.04, samples) * ms * 1e6).astype(int).tolist()
            r = bench.LengthResult(L, ns, [], -(-samples // L), bench.step_bytes(TINY, 8 + (L + 1) / 2))
            results[L] = {**r.summary(bandwidth["bytes_per_s"]), "decode_ns": ns}
        if name == "HF static+compile":
            results["fullgraph"] = True
    path.write_text(json.dumps(record))


def serve_json(path: Path) -> None:
    """A record with benchmarks/serve_latency.py's layout (its rows and their summary); times made up."""
    rows = []
    for L, stream_ms, added in ((64, 3.0, 0.05), (256, 3.1, 0.08)):
        summary = {"stream_token_ms_p50": stream_ms, "stream_token_ms_mean": stream_ms,
                   "engine_token_ms_mean": stream_ms + 0.01, "client_gap_ms_p50": stream_ms + added,
                   "client_gap_ms_p99": stream_ms + 3 * added, "client_token_ms_mean": stream_ms + added,
                   "added_ms_per_token": added, "stream_ttft_ms_p50": 4.0, "client_ttft_ms_p50": 4.6}
        rows.append({"length": L, "tokens": [L], "chunks": [L], "summary": summary})
    path.write_text(json.dumps({"model": "llama-2-7b", "device": "cuda", "rows": rows, "date": "2026-12-01",
                                "complete": True}))


def batch_json(path: Path) -> None:
    """`cullama bench --batch` on the CPU, B = 1, 2 and 8."""
    result = CliRunner().invoke(cli, ["bench", "--device", "cpu", "--batch", "1,2,8", "--samples", "3", "--warmup",
                                      "0", "--prompt-len", "2", "--json", str(path)])
    assert result.exit_code == 0, result.output


def serve_load_json(path: Path) -> None:
    """A record with benchmarks/serve_load.py's layout (its rows and their summary); times made up."""
    rows = []
    for c, gap, tps in ((1, 3.0, 330.0), (8, 3.6, 2200.0)):
        summary = {"ttft_ms_p50": 5.0, "ttft_ms_p99": 6.0 * c, "gap_ms_p50": gap, "gap_ms_p99": gap * 1.1,
                   "tokens_per_s": tps, "tokens_per_s_per_client": tps / c}
        rows.append({"concurrency": c, "ttft_ms": [5.0], "gap_ms": [gap], "tokens": [64] * c, "wall_s": 1.0,
                     "summary": summary})
    path.write_text(json.dumps({"model": "llama-2-7b", "device": "cuda", "max_batch": 8, "rows": rows,
                                "complete": True}))


def emu_vs_gpu_json(path: Path) -> None:
    """What tests/runtime/emu/test_emu_vs_gpu.py records (its `agree`): a row per case; differences made up."""
    cases = [{"case": "gemm (mma.sync) M=70 N=200 K=808 S=1", "max_abs_diff": 2e-6, "max_diff_over_bound": 1e-7,
              "tolerance": 1e-5},
             {"case": "attention_prefill_mma {'HEAD_DIM': 64}", "max_abs_diff": 1e-3, "max_diff_over_bound": 4e-4,
              "tolerance": 2e-3}]
    path.write_text(json.dumps({"cases": cases}))


def make_results(directory: Path, monkeypatch, capsys) -> Path:
    from functools import partial

    from cullama.runtime.backends import func_attr

    monkeypatch.setattr(func_attr, "allow_dynamic_shared", partial(func_attr.allow_dynamic_shared,
                                                                   library=fake_cupy.libcuda))
    runs = [("gemv_sweep", ["--model", "tiny", "--trials", "2", "--launches", "2", "--l2-multiple", "1"], "gemv.json"),
            ("gemm_sweep", ["--model", "tiny", "--rows", "1,10", "--splits", "2", "--trials", "1", "--launches", "1",
                            "--l2-multiple", "0"], "gemm.json"),
            ("decode_step", DECODE_ARGS, "decode.json"),
            ("prefill_step", ["--model", "tiny", "--lengths", "3,10", "--chunks", "8,16", "--trials", "1"],
             "prefill.json"),
            ("gemv_sweep", ["--model", "tiny", "--bits", "4,8", "--trials", "1", "--launches", "2", "--l2-multiple",
                            "1"], "gemv_quant.json"),
            ("gemm_sweep", ["--model", "tiny", "--kernels", "mma-w4,mma-w8", "--rows", "1,10", "--splits", "2",
                            "--trials", "1", "--launches", "1", "--l2-multiple", "0"], "gemm_quant.json"),
            ("gemv_sweep", ["--model", "tiny", "--rows", "1,2,16", "--trials", "1", "--launches", "1",
                            "--l2-multiple", "0"], "gemv_rows.json"),
            ("gemv_sweep", ["--model", "tiny", "--bits", "4,8", "--rows", "1,5", "--trials", "1", "--launches", "1",
                            "--l2-multiple", "0"], "gemv_rows_quant.json")]
    for script, argv, name in runs:
        code, _ = run_main(script, argv + ["--json", str(directory / name)], capsys)
        assert code == 0, script
    bench_json(directory / "bench.json")
    bench_json(directory / "bench_overlap.json", "--overlap")
    bench_json(directory / "bench_int4.json", "--quantize", "int4")
    bench_json(directory / "bench_int8.json", "--quantize", "int8")
    for name in ("bench_llama3-8b.json", "bench_llama3.2-1b.json"):  # the tiny preset's: those presets need a GPU
        bench_json(directory / name)
    compare_json(directory / "compare.json")
    speculative_json(directory / "speculative.json")
    serve_json(directory / "serve.json")
    emu_vs_gpu_json(directory / "emu_vs_gpu.json")
    batch_json(directory / "batch.json")
    serve_load_json(directory / "serve_load.json")
    return directory


@pytest.fixture
def made(fake, monkeypatch, tmp_path_factory, capsys):  # noqa: F811 - fake: the imported fixture
    """The directory of real JSON files, made once (the first test to ask), read-only for the tests."""
    if "dir" not in _MADE:
        _MADE["dir"] = make_results(tmp_path_factory.mktemp("results"), monkeypatch, capsys)
    return _MADE["dir"]


@pytest.fixture
def records(made):
    return {n: json.loads((made / n).read_text()) for n in NAMES}


def write(directory: Path, records: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, record in records.items():
        (directory / name).write_text(json.dumps(record))
    return directory


def report(path, capsys) -> str:
    code = summarize.main([str(path)])
    out = capsys.readouterr()
    assert code == 0 and out.err == ""
    return out.out


def section(text: str, title_start: str) -> str:
    start = text.index(f"### {title_start}")
    end = text.find("\n### ", start + 4)
    return text[start:] if end < 0 else text[start:end]


def target(text: str, start: str) -> tuple[str, str]:
    """(measured, status) of the Targets row whose target starts with `start`."""
    (line,) = [line for line in section(text, "Targets").splitlines() if line.startswith(f"| {start}")]
    cells = [c.strip() for c in line.strip("|").split(" | ")]
    return cells[2], cells[3]


def decision(text: str, name: str) -> str:
    (line,) = [line for line in section(text, "Decisions").splitlines() if line.startswith(f"- **{name}")]
    return line


def table_row(text: str, first: str) -> list[str]:
    rows = [line for line in text.splitlines() if line.startswith(f"| {first} |")]
    assert rows, first
    return [c.strip() for c in rows[0].strip("|").split(" | ")]


# -- the report on the real files -------------------------------------------------------------------
def test_every_section_with_numbers_recomputed_from_the_json(made, records, capsys):
    text = report(made, capsys)
    for _, title, _ in summarize.SECTIONS:
        assert f"### {title}" in text
    assert "### Targets" in text and "### Decisions" in text and "missing" not in text.split("###")[0]
    b = records["bench.json"]
    assert text.startswith(f"## {b['date'][:10]} — ") and f"commit {b['commit'][:10]}" in text.splitlines()[0]
    assert f"**CuPy** {b['environment']['cupy']}" in text

    bench_sec = section(text, "cullama bench (bench.json)")
    for r in b["results"]:
        ms = np.asarray(r["decode_ns"]) / 1e6
        p50, p99 = np.percentile(ms, [50, 99])
        row = table_row(bench_sec, str(r["length"]))
        assert row[2] == f"{p50:.3f}" and row[4] == f"{p99:.3f}" and row[6] == f"{p99 / p50:.3f}"
        assert row[9] == "—"  # no % of read bandwidth on the CPU
        assert row[10] == f"{np.percentile(np.asarray(r['ttft_ns']) / 1e6, 50):.3f}"

    over = section(text, "Overlap")
    assert "ran with overlap off" in over  # the CPU ignores --overlap: said, not hidden
    o10 = next(r for r in records["bench_overlap.json"]["results"] if r["length"] == 10)
    b10 = next(r for r in b["results"] if r["length"] == 10)
    row = table_row(over, "10")
    assert row[1:3] == [f"{b10['p50_ms']:.3f}", f"{o10['p50_ms']:.3f}"]
    assert row[3] == f"{100 * (o10['p50_ms'] - b10['p50_ms']) / b10['p50_ms']:+.1f} %"

    dec = section(text, "Decode step")
    for r in records["decode.json"]["rows"]:
        row = table_row(dec, str(r["context"]))
        assert row[2] == f"{r['graph_ms']:.3f}" and row[4] == f"{r['overlap_ms']:.3f}"
        assert row[7:9] == [f"{r['next_ms']:.3f}", f"{r['ahead_ms']:.3f}"]
    assert "| lm_head |" in dec and "| sample |" in dec

    pre = section(text, "Prefill")
    rows = records["prefill.json"]["rows"]
    for L in (3, 10):
        best = min((r for r in rows if r["length"] == L), key=lambda r: r["ttft_ms"])
        row = table_row(pre, str(L))
        assert row[1] == f"chunk {best['chunk']} {best['gemm']}+{best['attention']}" + \
            (" overlapped" if best["overlap"] else "")
        assert row[2] == f"{best['ttft_ms']:.2f}"
    assert table_row(pre, "16")[1] == "mma+scalar" and table_row(pre, "16")[-1] == "ok"
    cache = pre[pre.index("Prefix cache"):]
    for c in records["prefill.json"]["prefix_cache"]:  # chunk 8: L=10 finds one whole chunk, L=3 none
        row = table_row(cache, str(c["length"]))
        assert row[1:4] == [str(c["reused"]), f"{c['ttft_ms']:.2f}", f"{c['fresh_ttft_ms']:.2f}"] and row[-1] == "yes"
    assert [c["reused"] for c in records["prefill.json"]["prefix_cache"]] == [0, 8] and "WRONG" not in cache

    gemv = section(text, "GEMV")
    bw = records["gemv.json"]["read_bandwidth_bytes_per_s"]
    shapes = {}
    for r in records["gemv.json"]["rows"]:
        shapes.setdefault(r["shape"], []).append(r)
    assert len(shapes) == 5
    for shape, rs in shapes.items():
        best = max(rs, key=lambda r: r["gb_s"])
        default = next(r for r in rs if r["variant"] == DEFAULT_VARIANT)
        row = table_row(gemv, shape)
        assert row[2] == best["variant"] and row[4] == f"{best['gb_s']:.0f}"
        assert row[5] == f"{100 * best['gb_s'] * 1e9 / bw:.1f} %" and row[6] == f"{default['gb_s']:.0f}"

    gemm = section(text, "GEMM")
    cases = {}
    for r in records["gemm.json"]["rows"]:
        cases.setdefault((r["shape"], r["M"]), []).append(r)
    wins = {"mma": 0, "wgmma": 0}
    for rs in cases.values():
        wins[min(rs, key=lambda r: r["us"])["kernel"]] += 1
    assert f"mma in {wins['mma']} of {len(cases)}" in gemm and f"wgmma in {wins['wgmma']} of {len(cases)}" in gemm

    cmp_ = section(text, "cullama vs HuggingFace")
    eng = records["compare.json"]["engines"]
    for L in ("10", "100", "500"):
        row = table_row(cmp_, L)
        assert row[1:3] == [f"{eng['cullama'][L]['p50_ms']:.3f}", f"{eng['cullama'][L]['p99_ms']:.3f}"]
        assert f"{eng['HF eager'][L]['p99_ms'] / eng['cullama'][L]['p99_ms']:.2f}x" in row
    assert "fullgraph=True" in cmp_ and "torch 2.9.0" in cmp_

    # tiny on a CPU and a fake GPU; no L=500 in bench.json: TTFT at 500 unknown
    worst = max(r["p99_ms"] for r in b["results"])
    assert target(text, "decode p99")[1] == ("PASS" if worst <= 3.3 else "FAIL")
    assert f"worst p99 {worst:.3f} ms" in target(text, "decode p99")[0]
    assert target(text, "every GEMV")[1] == "FAIL"  # NumPy twins do not stream 3.9 TB/s
    assert target(text, "TTFT <= 15")[1] == "—" and "no L=500" in target(text, "TTFT <= 15")[0]
    assert target(text, "p99 >= 1.7x")[1] == "PASS" and target(text, "p99 >= 6x")[1] == "PASS"  # 2x and 8x made up
    assert "did not run overlapped against a plain bench.json" in decision(text, "Overlap")  # the CPU: plain
    assert "lengths [3, 10] give L=10 for both" in decision(text, "Prefill kernels")  # no long prompt: no rule


def test_a_prefix_cache_that_is_not_the_whole_prefill_is_said_wrong(records, tmp_path, capsys):
    records["prefill.json"]["prefix_cache"][1]["bit_exact"] = False
    cache = section(report(write(tmp_path / "r", records), capsys), "Prefill")
    assert table_row(cache[cache.index("Prefix cache"):], "10")[-1] == "NO"
    assert "- WRONG: the prefix cache at L=10 is not the whole prefill, bit for bit" in cache


def test_a_tgz_as_device_check_packs_it_and_its_out_directory(made, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    with tarfile.open(out / "results.tgz", "w:gz") as archive:  # tar -czf results.tgz -C "$RESULTS" .
        archive.add(made, arcname=".")
    (out / "summary.txt").write_text("install    ok                            9s\nbench      TIMEOUT (90s)  90s\n")
    (out / "steps.log").write_text("device_check: 2026-12-01T10:00:00Z, budget 500s, python: /usr/bin/python3\n"
                                   "name, driver_version, clocks.sm [MHz]\nNVIDIA H200, 570.86.15, 1980 MHz\n")
    from_dir = report(made, capsys)
    from_tgz = report(out / "results.tgz", capsys)
    from_out = report(out, capsys)
    side = ("- **files**", "- **steps**", "- **nvidia", "- **driver")  # where the side files or the source show
    strip = lambda t: [line for line in t.splitlines() if not line.startswith(side)]  # noqa: E731
    assert strip(from_dir) == strip(from_tgz) == strip(from_out)
    assert "install ok 9s; bench TIMEOUT (90s) 90s" in from_tgz and "driver release 570.86.15" in from_out
    assert "- **steps**" not in from_dir


def test_markdown_file_and_the_script_itself(made, tmp_path):
    md = tmp_path / "run.md"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "summarize.py"), str(made), "--markdown", str(md)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "" and md.read_text() == done.stdout
    assert "### Targets" in done.stdout
    for argv in ([str(tmp_path / "empty")], [str(tmp_path / "nope")]):
        (tmp_path / "empty").mkdir(exist_ok=True)
        done = subprocess.run([sys.executable, str(BENCHMARKS / "summarize.py"), *argv], capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2 and done.stdout == "" and len(done.stderr.splitlines()) == 1
        assert done.stderr.startswith("summarize: ") and "Traceback" not in done.stderr


# -- targets flip on edited copies ----------------------------------------------------------------
def passing(records: dict) -> dict:
    """The real records, edited to meet every target."""
    r = copy.deepcopy(records)
    b = r["bench.json"]
    (first, second) = b["results"]
    first.update(p50_ms=3.0, p99_ms=3.1, ttft_p50_ms=4.5)
    second.update(length=500, p50_ms=3.1, p99_ms=3.2, ttft_p50_ms=14.0)
    for row in r["gemv.json"]["rows"]:
        row["gb_s"] = 4000.0 if row["variant"] == DEFAULT_VARIANT else 3000.0
    d = r["decode.json"]["rows"]
    d[-1].update(context=500, graph_ms=3.4, overlap_ms=3.25)
    return r


def test_targets_pass_then_fail_one_at_a_time(records, tmp_path, capsys):
    good = passing(records)
    text = report(write(tmp_path / "good", good), capsys)
    for start in ("decode p99", "p99 / p50", "every GEMV", "whole 7B", "TTFT <= 5", "TTFT <= 15", "p99 >= 1.7x",
                  "p99 >= 6x"):
        assert target(text, start)[1] == "PASS", start
    assert "3.250 ms (overlap) at context 500" in target(text, "whole 7B")[0]
    assert "4.50 ms" in target(text, "TTFT <= 5")[0] and "best prefill.json pair" in target(text, "TTFT <= 5")[0]

    def flipped(edit, start, needle):
        r = copy.deepcopy(good)
        edit(r)
        measured, state = target(report(write(tmp_path / start.replace(" ", "_"), r), capsys), start)
        assert state == "FAIL" and needle in measured, (start, measured)

    flipped(lambda r: r["bench.json"]["results"][1].update(p99_ms=3.4), "decode p99", "above 3.3 at L=500")
    flipped(lambda r: r["bench.json"]["results"][0].update(p99_ms=3.2), "p99 / p50", "above 1.05 at L=10")
    flipped(lambda r: r["bench.json"]["results"][0].update(ttft_p50_ms=5.1), "TTFT <= 5", "5.10 ms")
    flipped(lambda r: r["bench.json"]["results"][1].update(ttft_p50_ms=15.5), "TTFT <= 15", "15.50 ms")
    flipped(lambda r: r["decode.json"]["rows"][-1].update(overlap_ms=3.35), "whole 7B", "3.350 ms (overlap)")

    def slow_qkv(r):
        for row in r["gemv.json"]["rows"]:
            if row["shape"].startswith("qkv"):
                row["gb_s"] = 3800.0 if row["variant"] == DEFAULT_VARIANT else 1000.0
    flipped(slow_qkv, "every GEMV", "below 3.9: qkv")

    def wrong_lm_head(r):
        for row in r["gemv.json"]["rows"]:
            if row["shape"].startswith("lm_head"):
                row["check_ok"] = False
    flipped(wrong_lm_head, "every GEMV", "no correct variant: lm_head")

    def close_compiled(r):
        r["compare.json"]["engines"]["HF static+compile"]["100"]["p99_ms"] = \
            1.5 * r["compare.json"]["engines"]["cullama"]["100"]["p99_ms"]
    flipped(close_compiled, "p99 >= 1.7x", "below 1.7x at L=100")

    r = copy.deepcopy(good)  # a value recorded as null (or missing) is unknown, not a pass or a failure
    r["bench.json"]["results"][0]["p99_ms"] = None
    r["bench.json"]["results"][0]["ttft_p50_ms"] = None
    text = report(write(tmp_path / "nulls", r), capsys)
    assert target(text, "decode p99") == ("p99 missing at L=10", "—")
    assert target(text, "TTFT <= 5")[1] == "—" and table_row(section(text, "cullama bench"), "10")[4] == "—"


def test_serving_and_executor_checks(records, tmp_path, capsys):
    text = report(write(tmp_path / "good", records), capsys)
    assert table_row(section(text, "Serving"), "256")[7] == "0.080"
    assert "2 cases" in target(text, "the CPU executor")[0] and target(text, "the CPU executor")[1] == "PASS"
    assert target(text, "cullama serve adds") == ("worst 0.080 ms added per token at L=256", "PASS")
    r = copy.deepcopy(records)
    r["serve.json"]["rows"][0]["summary"]["added_ms_per_token"] = 0.25
    r["emu_vs_gpu.json"]["cases"][1]["max_diff_over_bound"] = 5e-3
    text = report(write(tmp_path / "bad", r), capsys)
    assert target(text, "cullama serve adds") == ("worst 0.250 ms added per token at L=64", "FAIL")
    assert "beyond tolerance: attention_prefill_mma" in target(text, "the CPU executor")[0]
    assert target(text, "the CPU executor")[1] == "FAIL"
    r["serve.json"]["device"] = "cpu"  # the CPU smoke run is never judged
    assert target(report(write(tmp_path / "cpu", r), capsys), "cullama serve adds")[1] == "—"


def test_family_presets_against_their_floors(records, tmp_path, capsys):
    """bench_llama3-8b.json and bench_llama3.2-1b.json: each p99 against 1.1 x its own record's floor, on a GPU only."""
    text = report(write(tmp_path / "cpu", records), capsys)
    assert target(text, "llama3-8b: p99 within 10 %") == ("bench_llama3-8b.json ran on cpu, not a GPU", "—")
    floor = records["bench_llama3-8b.json"]["weights"]["floor_ms_h200"]
    assert f"floor {floor:.3f} ms" in section(text, "Model families: cullama bench --synthetic llama3-8b")
    r = copy.deepcopy(records)
    for name, floor, p99s in (("bench_llama3-8b.json", 3.38, {10: 3.70, 20: 3.60}),
                              ("bench_llama3.2-1b.json", 0.557, {10: 0.60, 20: 0.62})):
        r[name]["device"], r[name]["weights"]["floor_ms_h200"] = "cuda", floor
        for row in r[name]["results"]:
            row["p99_ms"] = p99s[row["length"]]
    text = report(write(tmp_path / "gpu", r), capsys)
    assert target(text, "llama3-8b: p99 within 10 %") == ("worst p99 3.700 ms at L=10, 1.09x the floor 3.380 ms",
                                                         "PASS")
    assert target(text, "llama3.2-1b: p99 within 10 %") == ("worst p99 0.620 ms at L=20, 1.11x the floor 0.557 ms",
                                                           "FAIL")
    del r["bench_llama3.2-1b.json"]
    text = report(write(tmp_path / "missing", r), capsys)
    assert target(text, "llama3.2-1b: p99 within 10 %")[1] == "—"
    assert "bench_llama3.2-1b.json missing" in section(text, "Model families: cullama bench --synthetic llama3.2-1b")


# -- decisions follow their rules -----------------------------------------------------------------
def overlapped(records: dict, gain: float = 0.02) -> dict:
    """decode.json overlapped `gain` faster everywhere, bench_overlap.json run overlapped, its p99 not worse."""
    r = copy.deepcopy(records)
    for row in r["decode.json"]["rows"]:
        row["overlap_ms"] = row["graph_ms"] * (1 - gain)
    r["bench_overlap.json"]["options"]["overlap"] = True
    base = {x["length"]: x for x in r["bench.json"]["results"]}
    for x in r["bench_overlap.json"]["results"]:
        x["p99_ms"] = base[x["length"]]["p99_ms"]
    return r


def test_overlap_decision(records, tmp_path, capsys):
    on = overlapped(records)
    assert "turn it **on**" in decision(report(write(tmp_path / "on", on), capsys), "Overlap")
    small = overlapped(records, gain=0.005)  # 0.5 %: not more than 1 %
    line = decision(report(write(tmp_path / "small", small), capsys), "Overlap")
    assert "keep it **off**" in line and "-0.5 % at context 3" in line and "not faster by more" in line
    worse = copy.deepcopy(on)
    worse["bench_overlap.json"]["results"][1]["p99_ms"] *= 1.01
    line = decision(report(write(tmp_path / "worse", worse), capsys), "Overlap")
    assert "keep it **off**" in line and "worse at L=20" in line
    none = copy.deepcopy(on)
    none["decode.json"]["rows"][0]["overlap_ms"] = None  # before sm_90: no overlapped graph at all
    assert "keep it **off**" in decision(report(write(tmp_path / "none", none), capsys), "Overlap")
    (tmp_path / "gone").mkdir()
    write(tmp_path / "gone", {n: v for n, v in on.items() if n != "bench_overlap.json"})
    line = decision(report(tmp_path / "gone", capsys), "Overlap")
    assert "no recommendation" in line and "bench_overlap.json missing" in line


def prefill_times(records: dict, times: dict, wrong=(), chunk_16: int = 16) -> dict:
    """prefill.json with lengths 3 -> 10 and 10 -> 500, chunk 16 -> chunk_16 and TTFT {(chunk, gemm, attention):
    (ms at 10, ms at 500)} (others 50 and 500 ms); the combos in `wrong` fail their check."""
    r = copy.deepcopy(records)
    for row in r["prefill.json"]["rows"]:
        row["length"] = {3: 10, 10: 500}[row["length"]]
        row["chunk"] = chunk_16 if row["chunk"] == 16 else row["chunk"]
        combo = (row["chunk"], row["gemm"], row["attention"])
        row["ttft_ms"] = times.get(combo, (50.0, 500.0))[row["length"] == 500]
        row["check_ok"] = combo not in wrong
    return r


def test_prefill_decision(records, tmp_path, capsys):
    times = {(16, "wgmma", "mma"): (4.0, 12.0),  # fastest at 500, but 14 % slower than the best at 10
             (8, "wgmma", "mma"): (3.6, 12.5),  # second at 500, within 5 % at 10: the choice
             (8, "mma", "mma"): (3.5, 14.0)}  # fastest at 10
    r = prefill_times(records, times)
    line = decision(report(write(tmp_path / "a", r), capsys), "Prefill kernels")
    assert "make default GEMM **wgmma**, attention **mma**, chunk **8**" in line
    assert "passed over" in line and "chunk 16 wgmma+mma (+14%)" in line
    r = prefill_times(records, times, wrong={(8, "wgmma", "mma")})  # WRONG: out, whatever its speed
    line = decision(report(write(tmp_path / "b", r), capsys), "Prefill kernels")
    assert "GEMM **mma**, attention **mma**, chunk **8**" in line and "disqualified (WRONG): chunk 8 wgmma+mma" in line
    text = report(write(tmp_path / "b", r), capsys)
    assert "WRONG at L=10,500" in section(text, "Prefill")
    r = prefill_times(records, {(plan.PREFILL_CHUNK, "mma", "scalar"): (3.0, 10.0)}, chunk_16=plan.PREFILL_CHUNK)
    line = decision(report(write(tmp_path / "c", r), capsys), "Prefill kernels")
    assert line.startswith("- **Prefill kernels and chunk**: keep GEMM **mma**, attention **scalar**, "
                           f"chunk **{plan.PREFILL_CHUNK}**")


def test_gemv_and_gemm_decisions(records, tmp_path, capsys):
    r = copy.deepcopy(records)
    for row in r["gemv.json"]["rows"]:
        down = row["shape"].startswith("down")
        speeds = {DEFAULT_VARIANT: 3000.0, OTHER_VARIANT: 3500.0 if down else 3020.0}
        row["gb_s"] = speeds.get(row["variant"], 100.0)
    for row in r["gemm.json"]["rows"]:
        row["us"] = (10.0 if row["kernel"] == "wgmma" else 20.0) * row["splits"]
    r["gemm.json"]["rows"][0]["us"] = 1.0  # mma wins one case, still loses in total
    fastest = {}
    for row in r["gemm.json"]["rows"]:
        if row["kernel"] == "mma":
            key = (row["shape"], row["M"])
            fastest[key] = min(fastest.get(key, float("inf")), row["us"])
    sum_mma = sum(fastest.values())
    text = report(write(tmp_path / "a", r), capsys)
    line = decision(text, "GEMV")
    assert f"down 256x688: {OTHER_VARIANT} (+16.7 % over the default)" in line
    assert f"qkv 384x256: keep {DEFAULT_VARIANT} (fastest {OTHER_VARIANT} +0.7 %)" in line
    assert "per shape; the plan has one" in line
    gemm = decision(text, "Prefill GEMM")
    n = len({(x["shape"], x["M"]) for x in r["gemm.json"]["rows"]})
    assert "**wgmma**" in gemm and f"mma {sum_mma:.1f} us, fastest in 1 of {n}" in gemm
    for row in r["gemm.json"]["rows"]:
        if row["kernel"] == "wgmma" and row["M"] == 10 and row["shape"].startswith("qkv"):
            row["check_ok"] = False  # no correct S for one case: out
    gemm = decision(report(write(tmp_path / "b", r), capsys), "Prefill GEMM")
    assert "**mma**" in gemm and "wgmma out (no correct S in some case)" in gemm


def test_quantized_sections_target_and_decision(made, records, tmp_path, capsys):
    """The W4 / W8 GEMV table (effective GB/s, % of the read bandwidth, the speedup over the same shape's FP16
    GEMV), the prefill GEMM's, the 3.9 TB/s target and the variant decision per bits, from edited copies."""
    from cullama.runtime.ops import gemv_mma

    text = report(made, capsys)
    sec = section(text, "Quantized GEMVs")
    bw = records["gemv_quant.json"]["read_bandwidth_bytes_per_s"]
    rows = records["gemv_quant.json"]["rows"]
    best = max((r for r in rows if r["bits"] == 4 and r["shape"].startswith("qkv")), key=lambda r: r["gb_s"])
    row = table_row(sec, f"W4 {best['shape']}")
    assert row[1:6] == ["gemv_qkv_rope", best["variant"], f"{best['us']:.2f}", f"{best['gb_s']:.0f}",
                        f"{100 * best['gb_s'] * 1e9 / bw:.1f} %"]
    fp16 = min(r["us"] for r in records["gemv.json"]["rows"] if r["shape"] == best["shape"])
    assert row[8] == f"{fp16 / best['us']:.2f}x"
    assert "W4 down" not in sec and "W8 down 256x688" in sec  # INT4 cannot hold K = 688: not swept
    gemm = section(text, "Quantized prefill GEMM")
    assert "| mma-w4 |" in gemm and "| mma-w8 |" in gemm
    assert target(text, "every W4 / W8 GEMV")[1] == "FAIL"  # the CPU's fake GPU is far from 3.9 TB/s

    r = copy.deepcopy(records)
    default4 = " ".join(f"{k}={v}" for k, v in gemv_mma.defines(4, 1, gemv_mma.K_BLOCK_GROUP))
    other4 = next(row["variant"] for row in r["gemv_quant.json"]["rows"]
                  if row["bits"] == 4 and row["variant"] != default4)
    for row in r["gemv_quant.json"]["rows"]:
        row["gb_s"] = 4000.0 if row["variant"] == default4 or row["bits"] == 8 else 3950.0
        row["us"] = row["weight_bytes"] / row["gb_s"] / 1e3
    out = report(write(tmp_path / "q", r), capsys)
    measured, status = target(out, "every W4 / W8 GEMV")
    assert status == "PASS" and "W4 qkv 4.00" in measured
    assert f"W4: keep {default4}" in decision(out, "Quantized GEMV")
    for row in r["gemv_quant.json"]["rows"]:
        if row["bits"] == 4 and row["variant"] == other4:
            row["us"] /= 2
    line = decision(report(write(tmp_path / "q2", r), capsys), "Quantized GEMV")
    assert f"W4: **{other4}**" in line and "cullama/runtime/ops/gemv_mma.py defines" in line
    first = r["gemv_quant.json"]["rows"][0]
    for row in r["gemv_quant.json"]["rows"]:
        if (row["bits"], row["shape"]) == (first["bits"], first["shape"]):
            row["check_ok"] = False  # no correct variant left for that shape
    measured, status = target(report(write(tmp_path / "q3", r), capsys), "every W4 / W8 GEMV")
    assert status == "FAIL" and f"no correct variant: W4 {first['shape']}" in measured


def test_quantized_bench_sections_and_targets(made, records, tmp_path, capsys):
    """`cullama bench --quantize int4|int8`: the weights and their floor over the bench table, and the issue's
    p99 targets (INT4 1.1 ms, INT8 1.8 ms at every L from 10 to 500) judged on their own file, not bench.json's."""
    text = report(made, capsys)
    for bits in (4, 8):
        sec = section(text, f"INT{bits} decode")
        weights = records[f"bench_int{bits}.json"]["weights"]
        assert f"Weights: {weights['weights']}" in sec and "int" in weights["weights"]
        assert f"reads {weights['decode_bytes'] / 1e9:.2f} GB" in sec
        assert "| 10 |" in sec and "| 20 |" in sec
    r = copy.deepcopy(records)
    for name, p99 in (("bench_int4.json", 1.05), ("bench_int8.json", 1.9)):
        r[name]["results"] = [{**row, "length": L, "p99_ms": p99} for row, L in zip(r[name]["results"], (10, 500))]
    r["bench.json"]["results"] = [{**row, "p99_ms": 9.0} for row in r["bench.json"]["results"]]
    out = report(write(tmp_path / "q", r), capsys)
    assert target(out, "INT4 decode p99 <= 1.1 ms")[1] == "PASS"
    measured, status = target(out, "INT8 decode p99 <= 1.8 ms")
    assert status == "FAIL" and "above 1.8 at L=10,500" in measured
    del r["bench_int4.json"]
    measured, status = target(report(write(tmp_path / "q2", r), capsys), "INT4 decode p99")
    assert status == "—" and "bench_int4.json missing" in measured


def test_batched_decode_sections_and_targets(made, records, tmp_path, capsys):
    """batch.json (the CPU's, as `cullama bench --batch` writes it) and serve_load.json: their tables, and issue
    17's targets, judged on a GPU only: B=8 step <= 1.25x B=1, at C=8 gap p99 <= 1.3x and tokens/s >= 6x C=1."""
    text = report(made, capsys)
    sec = section(text, "Batched decode")
    sizes = records["batch.json"]["sizes"]
    assert [s["batch"] for s in sizes] == [1, 2, 8]
    assert f"| 8 | 3 | {sizes[2]['p50_ms']:.3f} |" in sec
    assert "| 1 | 5.00 | 6.00 | 3.00 | 3.30 | 330.0 | 330.0 |" in section(text, "Many clients")
    measured, status = target(text, "batched step: B=8")
    assert status == "—" and "ran on cpu, not a GPU" in measured
    assert target(text, "a prompt joining B=8")[1] == "—"
    assert f"| {sizes[2]['join_p50_ms']:.3f} | {sizes[2]['join_max_ms']:.3f} | {sizes[2]['join_vs_step']:.2f}x |" in sec
    assert "| 1 | 3 |" in sec and sec.count("| — | — | — |") == 1  # B = 1: no join
    assert target(text, "serve at C=8: inter-token p99") == ("gap_ms_p99 at C=8 1.20x C=1's", "PASS")
    assert target(text, "serve at C=8: tokens/s") == ("tokens_per_s at C=8 6.67x C=1's", "PASS")

    r = copy.deepcopy(records)
    r["batch.json"]["device"] = "cuda"
    r["batch.json"]["sizes"][0]["p50_ms"], r["batch.json"]["sizes"][2]["p50_ms"] = 3.0, 3.9
    r["serve_load.json"]["rows"][1]["summary"]["tokens_per_s"] = 1800.0
    out = report(write(tmp_path / "b", r), capsys)
    assert target(out, "batched step: B=8") == ("B=8 p50 1.30x B=1's (3.900 / 3.000 ms)", "FAIL")
    assert target(out, "serve at C=8: tokens/s") == ("tokens_per_s at C=8 5.45x C=1's", "FAIL")
    for vs, status in ((2.4, "PASS"), (2.6, "FAIL")):
        r["batch.json"]["sizes"][2].update(join_p50_ms=3.9 * vs, join_vs_step=vs)
        assert target(report(write(tmp_path / f"j{vs}", r), capsys), "a prompt joining B=8") == \
            (f"join p50 {vs:.2f}x the B=8 step ({3.9 * vs:.3f} / 3.900 ms)", status)
    del r["batch.json"]["sizes"][2]
    assert "needs B=1 and B=8 (has [1, 2])" in target(report(write(tmp_path / "c", r), capsys), "batched step")[0]


def test_gemv_rows_sections(made, records, tmp_path, capsys):
    """gemv_rows.json / gemv_rows_quant.json (issue 26): per bits and shape, each row count's TB/s and time against
    the 1-row time, recomputed from the JSON; a count no plan launches shown as a dash and said; a wrong row said."""
    text = report(made, capsys)
    sec = section(text, "Decode GEMVs per token-row count, FP16")
    rows = records["gemv_rows.json"]["rows"]
    counts = sorted({r["tokens"] for r in rows})  # 1, 2 and, where the plans launch 16 rows, 16
    assert counts in ([1, 2], [1, 2, 16])
    assert "| bits shape | kernel | file | " + " | ".join(f"{t} rows TB/s (x 1-row)" for t in counts) + " |" in sec
    for r in rows:
        row = table_row(sec, f"FP16 {r['shape']}")
        cell = row[3 + counts.index(r["tokens"])]
        assert cell == f"{r['gb_s'] / 1e3:.2f} ({r['vs_1row']:.2f}x)"
    skipped = records["gemv_rows.json"]["skipped"]
    assert sec.count("- skipped:") == len(skipped) == (0 if 16 in counts else 5)
    quant = section(text, "Decode GEMVs per token-row count, W4 and W8")
    first = records["gemv_rows_quant.json"]["rows"][0]
    assert table_row(quant, f"W{first['bits']} {first['shape']}")[2] == first["source"]  # the plans' GEMV source
    r = copy.deepcopy(records)
    r["gemv_rows.json"]["rows"][1]["check_ok"] = False
    out = section(report(write(tmp_path / "w", r), capsys), "Decode GEMVs per token-row count, FP16")
    assert " WRONG" in out and f"- WRONG: {rows[1]['shape']} {rows[1]['tokens']} rows" in out


# -- missing, cut and odd files --------------------------------------------------------------------
def test_missing_cut_and_odd_files_are_notes(made, tmp_path, capsys):
    d = tmp_path / "partial"
    d.mkdir()
    (d / "bench.json").write_text((made / "bench.json").read_text())
    text = (made / "gemv.json").read_text()
    (d / "gemv.json").write_text(text[: len(text) // 2])  # cut short, as a killed writer leaves it
    (d / "decode.json").write_text("[1, 2]")
    odd = json.loads((made / "gemm.json").read_text())
    odd["rows"] = [{"kernel": "mma", "shape": "qkv", "M": 1, "us": None, "check_ok": True}, "junk"]
    (d / "gemm.json").write_text(json.dumps(odd))
    (d / "compare.json").write_text(json.dumps({"engines": {"cullama": {"error": "RuntimeError: boom"}}}))
    out = report(d, capsys)
    assert "*gemv.json unreadable (JSONDecodeError" in out and "decode.json unreadable (a JSON list" in out
    for name in ("bench_overlap.json", "prefill.json"):
        assert f"*{name} missing: the step" in out
    assert "FAILED: RuntimeError: boom" in out and "no lengths measured" in out
    assert target(out, "every GEMV") == ("gemv.json unreadable (JSONDecodeError: " + target(out, "every GEMV")[0]
                                         .split("(JSONDecodeError: ", 1)[1], "—")
    assert target(out, "whole 7B")[1] == "—" and target(out, "p99 >= 6x")[1] == "—"
    assert "**GEMV variant**: no recommendation, gemv.json unreadable" in out
    assert "**Prefill GEMM**: no kernel is correct in every case" in out
    assert "Traceback" not in out


def test_a_cut_archive_gives_what_came_before_the_cut(made, tmp_path, capsys):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as archive:
        for name in ("gemv.json", "bench.json"):  # bench.json is the big one: the cut falls inside it
            archive.add(made / name, arcname=f"./{name}")
    data = buf.getvalue()
    (tmp_path / "results.tgz").write_bytes(data[: int(len(data) * 0.8)])
    out = report(tmp_path / "results.tgz", capsys)
    assert "gemv.json ok" in out and "bench.json unreadable" in out and "is damaged" in out
    (tmp_path / "junk.tgz").write_bytes(b"not a gzip file")
    assert summarize.main([str(tmp_path / "junk.tgz")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "holds none of" in err
