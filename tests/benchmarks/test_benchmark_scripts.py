"""benchmarks/gemv_sweep.py, gemm_sweep.py and decode_step.py end to end on the CPU: CuPy is tests/fake_cupy.py
(kernels are the NumPy twins, events time them on the host clock), the shapes are the `tiny` preset's and every
count is the smallest that still runs each branch. A GPU session has minutes: none of them should go to a typo."""

import ctypes
import json
import runpy
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import fake_cupy
from cullama.runtime.backends import pdl
from cullama.model.config import preset
from cullama.runtime.load import FILL
from cullama.common.errors import DeviceError
from cullama.model import quant
from cullama.runtime.ops import gemv_mma as gemv_twins
from cullama.runtime.prefill_kernels import MMA_GEMM, WGMMA_GEMM
from cullama.runtime.registry import KernelLoader

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # as when they run as scripts: they import each other (from gemv_sweep ...)

import decode_step  # noqa: E402
import gemm_sweep  # noqa: E402
import gemv_sweep  # noqa: E402
import prefill_step  # noqa: E402

TINY = preset("tiny")
SCRIPTS = {"gemv_sweep": gemv_sweep, "gemm_sweep": gemm_sweep, "decode_step": decode_step,
           "prefill_step": prefill_step}


class FakePdl:
    """Stands in for backends.pdl.PdlLauncher (which calls libcuda): launches on the stream it is handed,
    which must be the current one (the capturing stream), and counts the launches."""

    def __init__(self):
        self.launches = self.captured = 0  # every overlapped launch; those made inside a stream capture

    def __call__(self, fn, grid, block, args, stream_ptr, smem=0):
        self.prepare(fn, grid, block, args, stream_ptr, smem)()

    def prepare(self, fn, grid, block, args, stream_ptr, smem=0):
        def launch():
            assert stream_ptr == fake_cupy.get_current_stream().ptr
            self.launches += 1
            self.captured += fake_cupy.state.capturing is not None
            fn(grid, block, args, shared_mem=smem)

        return launch


@pytest.fixture
def fake(monkeypatch):
    """The fake CuPy installed as in test_cuda_host.py, with a fake driver for PDL and event-record nodes."""
    fake_cupy.install(monkeypatch)
    monkeypatch.delenv("CULLAMA_OVERLAP", raising=False)  # plain by default: only measure() links by PDL
    launcher = FakePdl()
    monkeypatch.setattr(pdl, "PdlLauncher", lambda: launcher)
    monkeypatch.setattr(decode_step, "load_driver", lambda: fake_cupy.libcuda)
    fake_cupy.state.pdl = launcher
    return fake_cupy.state


def run_main(script, argv, capsys) -> tuple[int, str]:
    code = SCRIPTS[script].main(argv)
    return code, capsys.readouterr().out


def check_bandwidth(record):
    bandwidth = record["bandwidth"]
    assert bandwidth["buffer_bytes"] == fake_cupy.DEVICE_MEMORY // 4  # sized by the (fake) free memory
    assert bandwidth["reps_s"] and min(bandwidth["reps_s"]) > 0
    assert record["read_bandwidth_bytes_per_s"] == pytest.approx(bandwidth["buffer_bytes"] / min(bandwidth["reps_s"]))
    assert record["environment"]["gpu"] == fake_cupy.PROPERTIES["name"].decode()


def check_timing(row):
    assert 0 < row["us_min"] <= row["us"] <= row["us_max"]
    assert row["gb_s"] == pytest.approx(row["weight_bytes"] / row["us"] / 1e3)
    assert row["copies"] == max(3, -(-fake_cupy.L2_BYTES // row["weight_bytes"]))  # --l2-multiple 1
    assert row["launches_per_graph"] % row["copies"] == 0


# -- gemv_sweep -----------------------------------------------------------------------------------
def test_gemv_sweep_times_and_checks_every_variant_of_every_shape(fake, tmp_path, capsys):
    out = tmp_path / "gemv.json"
    code, stdout = run_main("gemv_sweep", ["--model", "tiny", "--trials", "2", "--launches", "2",
                                           "--l2-multiple", "1", "--json", str(out)], capsys)
    assert code == 0
    record = json.loads(out.read_text())
    check_bandwidth(record)
    variants = [" ".join(f"{k}={v}" for k, v in d) for d in gemv_sweep.SWEEP[16]]
    assert gemv_sweep.SWEEP[16][0] == gemv_twins.defines(16)  # the plan's decode variant first
    shapes = gemv_sweep.shapes(TINY)
    assert [(r["shape"], r["variant"]) for r in record["rows"]] == [(s[0], v) for s in shapes for v in variants]
    for row, (label, kernel, M, K) in zip(record["rows"], [s for s in shapes for _ in variants]):
        assert (row["kernel"], row["M"], row["K"], row["weight_bytes"]) == (kernel, M, K, 2 * M * K)
        assert row["check_ok"] and row["check_rel_err"] == 0  # the device ran the very twin the check runs
        check_timing(row)
        assert row["pct_read_bw"] == pytest.approx(100 * row["gb_s"] * 1e9 / record["read_bandwidth_bytes_per_s"])
    assert len(fake.graphs) == 2 * len(record["rows"])  # per row: the plain graph, then the overlapped one
    for graph, row in zip(fake.graphs[::2], record["rows"]):  # each graph rotates over every copy of W
        assert graph.replays == 1 + 2 and len(graph.launches) == row["launches_per_graph"]
        weights = {a.ctypes.data for launch in graph.launches for a in launch.args if a.shape == (row["M"], row["K"])}
        assert len(weights) == row["copies"]
        assert row["gb_s_overlap"] == pytest.approx(row["weight_bytes"] / row["us_overlap"] / 1e3)
    # overlapped: all but each graph's first launch went through the PDL launcher
    assert fake.pdl.launches == sum(r["launches_per_graph"] - 1 for r in record["rows"])
    lines = stdout.splitlines()
    assert lines[0].startswith("read bandwidth:") and "overlapped launches: timed too" in lines[0]
    assert lines[1].split()[:3] == ["shape", "kernel", "variant"]
    assert len(lines) == 2 + len(record["rows"]) + 2 and lines[-1] == f"wrote {out}"
    assert sum("*" in line for line in lines[2:-2]) == len(shapes)  # one fastest variant per shape


def test_gemv_sweep_times_no_overlap_before_sm90(fake, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(fake_cupy.device, "compute_capability", "80")
    out = tmp_path / "gemv.json"
    code, stdout = run_main("gemv_sweep", ["--model", "tiny", "--trials", "1", "--launches", "1",
                                           "--l2-multiple", "0", "--json", str(out)], capsys)
    assert code == 0 and "overlapped launches: not on sm_80" in stdout.splitlines()[0]
    assert all(r["us_overlap"] is None and r["gb_s_overlap"] is None for r in json.loads(out.read_text())["rows"])
    assert fake.pdl.launches == 0 and len(fake.graphs) == len(json.loads(out.read_text())["rows"])


def test_gemv_sweep_flags_a_wrong_variant_and_fails(fake, monkeypatch, capsys):
    def kernel(self, spec):  # the NTILES=2 build of every GEMV kernel writes nothing
        fn = fake_cupy.Kernel(spec)
        if ("NTILES", 2) in spec.defines:
            fn.twin = lambda *args: None
        return fn

    monkeypatch.setattr(KernelLoader, "function", kernel)
    code, stdout = run_main("gemv_sweep", ["--model", "tiny", "--trials", "1", "--launches", "1",
                                           "--l2-multiple", "0"], capsys)
    assert code == 1
    wrong = [line for line in stdout.splitlines() if "WRONG" in line]
    assert len(wrong) == len(gemv_sweep.shapes(TINY)) and all("NTILES=2" in line and "*" not in line for line in wrong)


def test_gemv_sweep_times_the_quantized_kernels(fake, tmp_path, capsys):
    """--bits 4,8: gemv_mma.cu's sweep variants of each bits on the four weight matrices (no lm_head), the effective
    bytes (codes and (scale, zero) pairs), and a shape INT4 cannot hold (tiny's K = 688) skipped with a line."""
    out = tmp_path / "gemv_quant.json"
    code, stdout = run_main("gemv_sweep", ["--model", "tiny", "--bits", "4,8", "--trials", "1", "--launches", "2",
                                           "--l2-multiple", "1", "--json", str(out)], capsys)
    assert code == 0
    record = json.loads(out.read_text())
    assert record["bits"] == [4, 8] and record["skipped"] == ["W4 down 256x688: K = 688 is not a multiple of 32"]
    expected = []
    for bits in (4, 8):
        group = (lambda K: K) if bits == 8 else gemv_sweep.Weights(4).group
        expected += [(bits, label, " ".join(f"{k}={v}" for k, v in d)) for label, kernel, M, K in gemv_sweep.shapes(TINY)
                     if kernel != "gemv_logits" and (bits == 8 or K % 32 == 0)
                     for d in gemv_sweep.sweep_variants(bits, group(K))]
    assert [(r["bits"], r["shape"], r["variant"]) for r in record["rows"]] == expected
    assert len(expected) == 14  # (3 + 4) shapes x 2 variants
    for r in record["rows"]:
        group = r["K"] if r["bits"] == 8 else 128
        assert r["weight_bytes"] == quant.QuantFormat(r["bits"], group).nbytes(r["M"], r["K"])
        assert r["check_ok"] and r["check_rel_err"] == 0
        check_timing(r)
    lines = stdout.splitlines()
    assert lines[1] == "skipped W4 down 256x688: K = 688 is not a multiple of 32"
    assert sum("*" in line for line in lines[3:-2]) == 3 + 4  # one fastest variant per (bits, shape)
    assert "BITS=4 TOKENS=1, BITS=8 TOKENS=1" in lines[-2] and "effective" in lines[-2]
    with pytest.raises(SystemExit):
        gemv_sweep.main(["--bits", "16,4"])
    assert "give 16 (FP16) or any of 4, 8" in capsys.readouterr().err


def test_gemv_sweep_rows_times_the_plans_kernel_per_token_count(fake, tmp_path, capsys):
    """--rows: per bits and shape, the kernel (spec and grid) the decode, verify and batch plans launch for each
    token count (read off the plans: gemv_mma.cu's once they launch it), checked against its twin on [T, width]
    token rows and timed; the time against the 1-row time; a count no plan launches skipped with a line."""
    from cullama.bench import gemvs

    out = tmp_path / "gemv_rows.json"
    code, stdout = run_main("gemv_sweep", ["--model", "tiny", "--bits", "4,8", "--rows", "1,2,5,9,16", "--trials", "1",
                                           "--launches", "2", "--l2-multiple", "1", "--json", str(out)], capsys)
    assert code == 0
    record = json.loads(out.read_text())
    assert record["token_rows"] == [1, 2, 5, 9, 16] and record["plan_variant"] == "read off the plans per row count"
    most = max(v.rows for v in gemvs.plan_variants(TINY, ["int4"]))
    counts = [t for t in (1, 2, 5, 9, 16) if t <= most]
    expected = []
    for bits, fmt in ((4, "int4"), (8, "int8")):
        variants = {(v.shape, v.rows): v for v in gemvs.plan_variants(TINY, [fmt])}
        for shape in ("qkv", "o_proj", "gate_up", "down"):
            expected += [(bits, shape, t, variants[shape, t]) for t in counts]
    assert len(record["rows"]) == len(expected) == 2 * 4 * len(counts)
    for r, (bits, shape, t, v) in zip(record["rows"], expected):
        assert (r["bits"], r["shape"].split()[0], r["tokens"], r["kernel"]) == (bits, shape, t, v.kernel)
        assert (r["source"], r["defines"], tuple(r["grid"])) == (v.source, dict(v.defines), v.grid)
        assert (r["M"], r["K"]) == (v.M, v.K) and r["weight_bytes"] == v.weight_bytes
        assert r["check_ok"] and r["check_rel_err"] == 0
        check_timing(r)
        one = next(o for o in record["rows"] if (o["bits"], o["shape"], o["tokens"]) == (bits, r["shape"], 1))
        assert r["vs_1row"] == pytest.approx(r["us"] / one["us"])
    if most < 16:
        assert len(record["skipped"]) == 2 * 4 and all(f"for 16 token rows (at most {most})" in line
                                                       for line in record["skipped"])
    lines = stdout.splitlines()
    assert lines[-1] == f"wrote {out}" and "x 1-row" in lines[-2] and "TB/s: effective" in lines[-2]
    assert sum(line.startswith("skipped") for line in lines) == len(record["skipped"])
    fp16 = tmp_path / "gemv_rows_fp16.json"
    assert run_main("gemv_sweep", ["--model", "tiny", "--rows", "1,2", "--trials", "1", "--launches", "1",
                                   "--l2-multiple", "0", "--json", str(fp16)], capsys)[0] == 0
    rows = json.loads(fp16.read_text())["rows"]
    assert [(r["shape"].split()[0], r["tokens"]) for r in rows] == [(s, t) for s in gemvs.SHAPE_ORDER for t in (1, 2)]
    with pytest.raises(SystemExit):
        gemv_sweep.main(["--rows", "1,17"])
    assert "token rows are 1 to 16" in capsys.readouterr().err


# -- gemm_sweep -----------------------------------------------------------------------------------
def test_gemm_sweep_times_and_checks_every_split(fake, tmp_path, capsys):
    out = tmp_path / "gemm.json"
    code, stdout = run_main("gemm_sweep", ["--model", "tiny", "--kernels", "mma", "--rows", "1,65", "--splits", "3",
                                           "--trials", "2", "--launches", "2", "--l2-multiple", "1", "--json",
                                           str(out)], capsys)
    assert code == 0
    record = json.loads(out.read_text())
    check_bandwidth(record)
    expected = [("mma", label, M, s) for label, N, K, _ in gemm_sweep.shapes(TINY) for M in (1, 65)
                for s in sorted({1, 3, MMA_GEMM.splits(M, N, K)})]
    assert [(r["kernel"], r["shape"], r["M"], r["splits"]) for r in record["rows"]] == expected
    assert {r["plan_splits"] for r in record["rows"]} == {1, 2}  # down's plan splits K: three S at once
    for r in record["rows"]:
        assert r["check_ok"] and r["plan_splits"] == MMA_GEMM.splits(r["M"], r["N"], r["K"])
        assert ("twin rel err" in r["check"]) == (r["splits"] == 1 and r["M"] <= 64)
        assert ("vs S=1" in r["check"]) == (r["splits"] > 1)
        check_timing(r)
        assert r["tflop_s"] == pytest.approx(2 * r["M"] * r["N"] * r["K"] / r["us"] / 1e6)
        assert r["speedup_vs_s1"] > 0 and (r["splits"] > 1 or r["speedup_vs_s1"] == 1)
    lines = stdout.splitlines()
    assert "SPLIT_K=True" in lines[0] and lines[1].split()[:4] == ["kernel", "shape", "M", "S"]
    assert len(lines) == 2 + len(expected) + 4 and lines[-1] == f"wrote {out}"
    assert lines[-3].startswith("the plan's S is the fastest in") and lines[-3].endswith(f"of {4 * 2} cases")
    assert lines[-2] == f"mma: fastest in {4 * 2} of {4 * 2} (shape, M) cases"


def test_gemm_sweep_times_the_quantized_gemm(fake, tmp_path, capsys):
    """mma-w4 / mma-w8: gemm_quant.cu with gemm.cu's split rule, checked against its twin and across splits; INT4
    skips tiny's down (K = 688)."""
    out = tmp_path / "gemm_quant.json"
    code, stdout = run_main("gemm_sweep", ["--model", "tiny", "--kernels", "mma-w4,mma-w8", "--rows", "1,65",
                                           "--splits", "2", "--trials", "1", "--launches", "2", "--l2-multiple", "1",
                                           "--json", str(out)], capsys)
    assert code == 0
    record = json.loads(out.read_text())
    expected = [(name, label, M) for name, bits in (("mma-w4", 4), ("mma-w8", 8))
                for label, N, K, _ in gemm_sweep.shapes(TINY) if K % (128 // bits) == 0 for M in (1, 65)]
    assert sorted({(r["kernel"], r["shape"], r["M"]) for r in record["rows"]}) == sorted(expected)
    for r in record["rows"]:
        bits = int(r["kernel"][-1])
        assert r["bits"] == bits and r["check_ok"], r
        assert r["plan_splits"] == MMA_GEMM.splits(r["M"], r["N"], r["K"])
        group = r["K"] if bits == 8 else 128
        assert r["weight_bytes"] == quant.QuantFormat(bits, group).nbytes(r["N"], r["K"])
        assert ("twin rel err" in r["check"]) == (r["splits"] == 1 and r["M"] <= 64)
    assert "skipped mma-w4 down 256x688" in stdout


def test_gemm_sweep_compares_the_wgmma_kernels_on_sm90(fake, monkeypatch, tmp_path, capsys):
    """On an sm_90 GPU the default sweeps both plan kernels; each wgmma variant is allowed its dynamic
    shared memory before its first launch and launched with it."""
    from cullama.runtime.backends import func_attr

    allowed, launched, real_allow = [], [], func_attr.allow_dynamic_shared
    monkeypatch.setattr(func_attr, "allow_dynamic_shared", lambda fn, n: allowed.append((fn.spec, n)) or
                        real_allow(fn, n, library=fake_cupy.libcuda))
    real = fake_cupy.Kernel.__call__
    monkeypatch.setattr(fake_cupy.Kernel, "__call__", lambda self, grid, block, args, shared_mem=0:
                        launched.append((self.spec, shared_mem)) or real(self, grid, block, args, shared_mem))
    out = tmp_path / "gemm.json"
    code, stdout = run_main("gemm_sweep", ["--model", "tiny", "--rows", "1,130", "--splits", "2", "--trials", "1",
                                           "--launches", "1", "--l2-multiple", "0", "--json", str(out)], capsys)
    assert code == 0
    record = json.loads(out.read_text())
    assert record["kernels"] == ["mma", "wgmma"]
    rows = [r for r in record["rows"] if r["kernel"] == "wgmma"]
    assert rows and all(r["check_ok"] and r["plan_splits"] == WGMMA_GEMM.splits(r["M"], r["N"], r["K"]) for r in rows)
    assert {r["blocks"] // r["splits"] for r in rows} >= {WGMMA_GEMM.tiles(130, rows[0]["N"])}
    assert (WGMMA_GEMM.spec, WGMMA_GEMM.smem) in allowed
    assert {n for spec, n in launched if spec == WGMMA_GEMM.spec} == {WGMMA_GEMM.smem}
    assert "wgmma: fastest in" in stdout
    with pytest.raises(SystemExit):
        gemm_sweep.main(["--kernels", "cublas"])
    assert "choose among mma, wgmma" in capsys.readouterr().err


def test_gemm_sweep_flags_a_nondeterministic_split(fake, monkeypatch, capsys):
    def kernel(self, spec):  # the split-K GEMM adds a different tiny amount at every launch
        fn = fake_cupy.Kernel(spec)
        if spec != MMA_GEMM.spec:
            return fn
        twin, calls = fn.twin, []

        def jittery(A, W, C, workspace, count, M, N, K, accumulate, **grid):
            twin(A, W, C, workspace, count, M, N, K, accumulate)
            if grid["grid"][2] > 1:  # within the 1e-5 of "vs S=1", not bitwise the same
                calls.append(1)
                C[:M, :N] += np.float32(1e-6) * len(calls)

        fn.twin, fn.wants_grid = jittery, True
        return fn

    monkeypatch.setattr(KernelLoader, "function", kernel)
    code, stdout = run_main("gemm_sweep", ["--model", "tiny", "--kernels", "mma", "--rows", "1", "--splits", "2",
                                           "--trials", "1", "--launches", "1", "--l2-multiple", "0"], capsys)
    assert code == 1
    assert all(("NOT DETERMINISTIC" in line) == (line.split()[4] == "2") for line in stdout.splitlines()[2:-3])


# -- decode_step ----------------------------------------------------------------------------------
DECODE_ARGS = ["--model", "tiny", "--contexts", "3,7", "--steps", "3", "--trials", "2", "--max-seq-len", "24",
               "--breakdown-context", "5", "--verify-drafts", "1,3", "--verify-context", "4"]


def test_decode_step_times_every_mode_and_every_kernel(fake, tmp_path, capsys):
    out = tmp_path / "decode.json"
    code, stdout = run_main("decode_step", DECODE_ARGS + ["--json", str(out)], capsys)
    assert code == 0
    record = json.loads(out.read_text())
    check_bandwidth(record)
    assert record["model"] == "tiny" and record["weight_bytes"] == TINY.decode_weight_bytes()
    assert record["floor_ms"] == pytest.approx(record["weight_bytes"] / record["read_bandwidth_bytes_per_s"] * 1e3)
    assert [r["context"] for r in record["rows"]] == [3, 7]
    for r in record["rows"]:
        assert r["steps"] == 3 and len(r["trials"]) == 2
        for key in ("graph_ms", "overlap_ms", "eager_ms", "next_ms", "ahead_ms"):
            assert all(t[key] > 0 for t in r["trials"]) and r[key] > 0, key
        assert r["graph_spread_ms"][0] <= r["graph_ms"] <= r["graph_spread_ms"][1]
        assert r["pct_of_floor"] == pytest.approx(100 * record["floor_ms"] / r["graph_ms"])
        assert r["floor_kv_ms"] > record["floor_ms"]
    launches = 5 * TINY.num_layers + 2
    # overlapped captures: the warm-up's and each trial's; every kernel but the graph's first is linked
    assert fake.pdl.captured == (1 + 2 * 2) * (launches - 1)
    assert fake.pdl.launches > fake.pdl.captured  # and the prefill chunks in overlap mode, launched eagerly
    breakdown = fake.graphs[-1]  # an event-record node before each launch and after the last
    assert len(breakdown.nodes) == 2 * launches + 1 and breakdown.replays == 3
    assert all(isinstance(n, fake_cupy.Event) == (i % 2 == 0) for i, n in enumerate(breakdown.nodes))
    kernels = {k["kernel"]: k for k in record["kernels"]}
    assert list(kernels) == list(decode_step.LAYER_LABELS) + ["lm_head", "sample"]
    for name, k in kernels.items():
        assert k["count"] == (1 if name in ("lm_head", "sample") else TINY.num_layers)
        assert k["us_each"] > 0 and k["us_per_step"] == pytest.approx(k["us_each"] * k["count"])
        assert k["bytes"] == decode_step.launch_bytes(TINY, name, 5 + 3 // 2)  # at the steps' middle context
        assert k["gb_s"] == pytest.approx(k["bytes"] / k["us_each"] / 1e3)
    verify = record["verify"]
    assert (verify["context"], verify["steps"], len(verify["trials"])) == (4, 3, 2) and verify["plain_ms"] > 0
    assert [r["k"] for r in verify["rows"]] == [1, 3]
    for r in verify["rows"]:
        assert r["replay_ms"] > 0 and r["verify_ms"] > 0 and r["x_plain"] > 0
    # one graph per k, each trial: a verify() that captures or replays it, 3 timed replays and 3 verify() calls
    verify_graphs = [g for g in fake.graphs if g.launches[0].spec.name == "embed_rows_prepared"]
    assert [(g.launches[-1].grid[0], g.replays) for g in verify_graphs] == [(2, 2 * 7), (4, 2 * 7)]
    assert "verify step (k drafts" in stdout and "<= 1.10" not in stdout  # targets at k = 4 and 8 only
    assert f"{launches} launches per decode step" in stdout
    progress = [line for line in stdout.splitlines() if line.startswith("  context ")]
    assert len(progress) == 2 and not any("n/a" in line for line in progress)
    table = stdout[stdout.index("overlap ms"):]
    assert "n/a" not in table and "context 5, 3 steps" in table and table.rstrip().endswith(f"wrote {out}")


def test_decode_step_before_sm_90_has_no_overlapped_time(fake, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(fake_cupy.device, "compute_capability", "80")
    out = tmp_path / "decode.json"
    code, stdout = run_main("decode_step", ["--model", "tiny", "--contexts", "2", "--steps", "1", "--trials", "1",
                                            "--max-seq-len", "19", "--breakdown-context", "2", "--verify-drafts", "2",
                                            "--verify-context", "2", "--json", str(out)],
                            capsys)
    assert code == 0 and fake.pdl.launches == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["overlap_ms"] is None and row["trials"][0]["overlap_ms"] is None and row["graph_ms"] > 0
    assert "overlapped n/a" in stdout


def fill_launch():
    """A kernel and its arguments, for the tests of events alone."""
    out = fake_cupy.zeros((8,), "float16")
    args = (out, fake_cupy.uint64(8), fake_cupy.uint64(1), fake_cupy.float32(0), fake_cupy.float32(1))
    return fake_cupy.Kernel(FILL), args


def test_decode_step_breakdown_events_are_graph_nodes_not_captured_records(fake):
    """The bug the breakdown had: a plain Event.record inside the capture leaves an event CUDA will not time."""
    stream, (kernel, args) = fake_cupy.Stream(non_blocking=True), fill_launch()
    plain, nodes = fake_cupy.Event(), [fake_cupy.Event(), fake_cupy.Event()]
    record = decode_step.node_recorder(fake_cupy.libcuda)
    with stream:
        stream.begin_capture()
        plain.record(stream)
        record(nodes[0], stream)
        kernel((1,), (256,), args)
        record(nodes[1], stream)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert fake_cupy.get_elapsed_time(*nodes) > 0
    with pytest.raises(fake_cupy.CaptureError, match="cudaErrorCapturedEvent"):
        fake_cupy.get_elapsed_time(plain, nodes[1])
    with pytest.raises(DeviceError, match="cuEventRecordWithFlags"):
        record(nodes[0], stream)  # an event-record node outside a capture: CUDA_ERROR_INVALID_VALUE


def test_load_driver_without_libcuda_is_a_device_error(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    with pytest.raises(DeviceError, match="libcuda.so.1"):
        decode_step.load_driver()


# -- the fake's events ----------------------------------------------------------------------------
def test_fake_events_time_their_stream_in_order_and_refuse_what_cuda_refuses(fake):
    stream, (kernel, args) = fake_cupy.Stream(non_blocking=True), fill_launch()
    start, middle, end = fake_cupy.Event(), fake_cupy.Event(), fake_cupy.Event()
    with pytest.raises(fake_cupy.CudaError, match="never recorded"):
        fake_cupy.get_elapsed_time(start, end)
    with stream:
        start.record()
        kernel((1,), (256,), args)
        middle.record()
        kernel((1,), (256,), args)
        end.record(stream)
    with pytest.raises(fake_cupy.CudaError, match="NotReady"):
        fake_cupy.get_elapsed_time(start, middle)
    middle.synchronize()
    assert len(fake.runs) == 1  # the stream ran up to the event, no further
    assert fake_cupy.get_elapsed_time(start, middle) > 0
    end.synchronize()
    assert len(fake.runs) == 2 and fake_cupy.get_elapsed_time(middle, end) > 0
    with pytest.raises(TypeError):
        kernel([1, 1, 1], (256,), args)  # CuPy takes tuples only


# -- one line when there is no GPU, argument errors, running as a script --------------------------
@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("why", ["no CuPy", "no device"])
def test_without_a_gpu_each_script_says_so_in_one_line(script, why, monkeypatch):
    if why == "no CuPy":
        monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    else:
        monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
        monkeypatch.setattr(fake_cupy.runtime, "getDeviceCount", lambda: 0)
    with pytest.raises(SystemExit) as exit_:
        SCRIPTS[script].main([])
    message = str(exit_.value.code)
    assert message.startswith(f"{script}: needs an NVIDIA GPU: ") and "\n" not in message
    assert ("CuPy" if why == "no CuPy" else "no NVIDIA GPU found") in message


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unknown_model_is_one_line(script, fake):
    with pytest.raises(SystemExit) as exit_:
        SCRIPTS[script].main(["--model", "nope"])
    assert str(exit_.value.code).startswith(f"{script}: unknown preset 'nope'")


@pytest.mark.parametrize("script,argv,needle", [
    ("gemv_sweep", ["--trials", "0"], "positive integer"),
    ("gemm_sweep", ["--rows", "1,0"], "positive integer"),
    ("gemm_sweep", ["--launches", "x"], "invalid positive_int value"),
    ("decode_step", ["--steps", "0"], "positive integer"),
    ("decode_step", ["--contexts", "1,x"], "comma-separated"),
    ("decode_step", ["--contexts", "0"], "positive integers"),
    ("decode_step", ["--contexts", "100", "--max-seq-len", "64"], "does not fit"),
    ("decode_step", ["--contexts", "10", "--breakdown-context", "500", "--max-seq-len", "400"], "does not fit"),
    ("decode_step", ["--contexts", "1", "--steps", "1", "--max-seq-len", "12", "--breakdown-context", "1"],
     "warm-up"),
])
def test_bad_arguments_are_usage_errors(script, argv, needle, capsys):
    with pytest.raises(SystemExit) as exit_:
        SCRIPTS[script].main(argv)
    assert exit_.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("script,options", [
    ("gemv_sweep", ["--model", "--launches", "--l2-multiple"]),
    ("gemm_sweep", ["--model", "--rows", "--splits"]),
    ("decode_step", ["--model", "--breakdown-context", "--max-seq-len"]),
])
def test_each_runs_as_a_script(script, options, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(BENCHMARKS / f"{script}.py"), run_name="__main__")
    usage = capsys.readouterr().out
    assert exit_.value.code == 0 and all(option in usage for option in options)


# -- prefill_step ---------------------------------------------------------------------------------
def test_prefill_step_times_every_kernel_pair_and_checks_it(fake, monkeypatch, tmp_path, capsys):
    from functools import partial

    from cullama.runtime.backends import func_attr

    monkeypatch.setattr(func_attr, "allow_dynamic_shared", partial(func_attr.allow_dynamic_shared,
                                                                   library=fake_cupy.libcuda))
    out = tmp_path / "prefill.json"
    code, stdout = run_main("prefill_step", ["--model", "tiny", "--lengths", "3,40", "--chunks", "16,40",
                                             "--trials", "2", "--json", str(out)], capsys)
    assert code == 0
    record = json.loads(out.read_text())
    check_bandwidth(record)
    cases = [(r["chunk"], r["overlap"], r["gemm"], r["attention"], r["length"]) for r in record["rows"]]
    assert cases == [(c, o, g, a, n) for c in (16, 40) for o in (False, True)
                     for g, a in (("mma", "scalar"), ("mma", "mma"), ("wgmma", "scalar"), ("wgmma", "mma"))
                     for n in (3, 40)]
    assert fake.pdl.launches > 0 and fake.pdl.captured == 0  # the overlapped prefills: eager, linked
    for r in record["rows"]:
        assert r["check_ok"] and r["logits_max_diff"] == 0.0  # the twins: the same function, bit for bit
        assert len(r["trials"]) == 2 and 0 < r["ttft_min_ms"] <= r["ttft_ms"] and r["floor_ms"] > 0
    # the prefix cache, default pair, first chunk (16): L=40 finds its two whole chunks, L=3 none
    cached = [(c["length"], c["reused"], c["bit_exact"]) for c in record["prefix_cache"]]
    assert cached == [(3, 0, True), (40, 32, True)]
    assert all(c["ttft_ms"] > 0 and c["fresh_ttft_ms"] == record["rows"][i]["ttft_ms"]
               for i, c in enumerate(record["prefix_cache"]))
    assert "  prefix cache L=40: 32 rows reused, " in stdout and "bit-exact: True" in stdout
    lines = stdout.splitlines()
    assert "pairs mma+scalar, mma+mma, wgmma+scalar, wgmma+mma; chunks 16, 40" in lines[0]
    assert lines[-1] == f"wrote {out}"
    monkeypatch.setattr(fake_cupy.device, "compute_capability", "80")  # no wgmma before sm_90
    code, stdout = run_main("prefill_step", ["--model", "tiny", "--lengths", "3", "--chunks", "8", "--trials", "1"],
                            capsys)
    assert code == 0 and "pairs mma+scalar, mma+mma" in stdout.splitlines()[0] and "wgmma" not in stdout
    assert "overlap" not in stdout.split("\n\n")[0]  # no programmatic dependent launch before sm_90
    assert all(" off " in line for line in stdout.splitlines() if line.startswith("    8 "))


# -- records: dated, attributed, and saved as the work goes -------------------------------------------
def test_a_sweep_cut_short_leaves_what_it_measured(fake, monkeypatch, tmp_path, capsys):
    """Each script saves its JSON after every unit of work (complete: false), then once more at the end
    (complete: true), with the date, the commit and its options: a step killed by device_check.sh's
    timeout still returns its first shapes."""
    from cullama.bench.latency import git_commit
    from cullama.common.errors import KernelError

    real = KernelLoader.function

    def kernel(self, spec):  # the second shape's kernel cannot be loaded
        if spec.name == gemv_sweep.shapes(TINY)[1][1]:
            raise KernelError("planted: no such kernel")
        return real(self, spec)

    monkeypatch.setattr(KernelLoader, "function", kernel)
    out = tmp_path / "gemv.json"
    with pytest.raises(SystemExit, match="planted"):
        gemv_sweep.main(["--model", "tiny", "--trials", "1", "--launches", "1", "--l2-multiple", "0",
                         "--json", str(out)])
    record = json.loads(out.read_text())
    assert record["complete"] is False and record["commit"] == git_commit() and record["date"].startswith("20")
    assert {r["shape"] for r in record["rows"]} == {gemv_sweep.shapes(TINY)[0][0]}
    assert record["options"]["model"] == "tiny" and "json" not in record["options"]
    assert record["plan_variant"] == "BITS=16 TOKENS=1" and not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(KernelLoader, "function", real)
    assert run_main("gemv_sweep", ["--model", "tiny", "--trials", "1", "--launches", "1", "--l2-multiple", "0",
                                   "--json", str(out)], capsys)[0] == 0
    assert json.loads(out.read_text())["complete"] is True


def test_serve_load_smoke_run_on_the_cpu(stories_dir, tmp_path, capsys):
    """benchmarks/serve_load.py end to end on the CPU with stories260K: a server with --max-batch 2, two levels of
    concurrency, every sample in the record. Its figures are not checked (a test is no benchmark)."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")
    import serve_load

    out = tmp_path / "load.json"
    assert serve_load.main(["--model", str(stories_dir), "--device", "cpu", "--concurrency", "1,3", "--tokens", "4",
                            "--rounds", "1", "--max-batch", "2", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["C", "requests"])
    assert [line.split()[:2] for line in lines[header + 1:header + 3]] == [["1", "1"], ["3", "3"]]
    record = json.loads(out.read_text())
    assert record["complete"] and record["max_batch"] == 2 and [r["concurrency"] for r in record["rows"]] == [1, 3]
    assert all(r["tokens"] == [4] * r["concurrency"] and len(r["ttft_ms"]) == r["concurrency"] for r in record["rows"])
    assert all(r["summary"]["gap_ms_max"] == max(r["gap_ms"]) for r in record["rows"])
    for r, line in zip(record["rows"], lines[header + 1:header + 3]):  # the summary is its samples', as shown
        s = r["summary"]
        # (the p99 of fewer than 100 samples is their largest)
        assert (s["ttft_ms_p50"], s["ttft_ms_p99"]) == (statistics.median(r["ttft_ms"]), max(r["ttft_ms"]))
        assert (s["gap_ms_p50"], s["gap_ms_p99"]) == (statistics.median(r["gap_ms"]), max(r["gap_ms"]))
        assert s["tokens_per_s"] == sum(r["tokens"]) / r["wall_s"]
        assert s["tokens_per_s_per_client"] == pytest.approx(s["tokens_per_s"] / r["concurrency"])
        shown = [s["ttft_ms_p50"], s["ttft_ms_p99"], s["gap_ms_p50"], s["gap_ms_p99"]]
        assert line.split()[3:5] + line.split()[6:8] == [f"{v:.2f}" for v in shown], line
        assert line.split()[9] == f"{s['tokens_per_s']:.1f}", line


def test_serve_load_side_by_side_interleaves_and_compares(stories_dir, tmp_path, capsys):
    """--url twice (one server under two names): each path's lines, the second against the first, the medians of
    --repeats runs, every run in the record. Figures not checked."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")
    import serve_load

    from tests.serving import running

    out = tmp_path / "side.json"
    with running(stories_dir, tmp_path) as server:
        urls = [f"http://127.0.0.1:{server.port}", f"http://localhost:{server.port}"]
        assert serve_load.main(["--url", urls[0], "--url", urls[1], "--concurrency", "1,2", "--tokens", "4",
                                "--rounds", "2", "--repeats", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    a, b = f"127.0.0.1:{server.port}", f"localhost:{server.port}"
    assert text.count(f"{b} against {a}: TTFT p50") == 2 * 2 + 2  # per level and run, then the medians
    record = json.loads(out.read_text())
    assert record["paths"] == [a, b] and len(record["runs"]) == 2
    for run in record["runs"]:
        assert [row["concurrency"] for row in run[b]] == [1, 2] and all("against" in row for row in run[b])
        assert [len(row["ttft_ms"]) for row in run[a]] == [2, 4]  # rounds x clients, interleaved
