"""`cullama bench`: the statistics on a fake runner with a fake clock, the JSON record, option errors,
the bandwidth kernel and its twin, and the whole command end to end on the CPU."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from cullama.bench import latency as bench
from cullama.cli.main import main
from cullama.model.config import preset
from cullama.runtime.ops import bandwidth as twin
from cullama.runtime.registry import KernelSpec, compile_module
from tests.conftest import FAKE_GPU, poisoned

TINY = preset("tiny")


class FakeRunner:
    """start() costs `ttft_ns`; the n-th next() of a trial costs `step_ns(trial, n)`, on a fake clock."""

    def __init__(self, step_ns, ttft_ns=5_000_000, max_seq_len=1024):
        self.now, self.trial, self.n, self.starts, self.prompts = 0, -1, 0, 0, []
        self.step_ns, self.ttft_ns, self.max_seq_len = step_ns, ttft_ns, max_seq_len

    def clock(self):
        return self.now

    def start(self, prompt_ids, params):
        assert params.temperature == 0  # greedy
        self.trial, self.n, self.starts = self.trial + 1, 0, self.starts + 1
        self.prompts.append(list(prompt_ids))
        self.now += self.ttft_ns
        return 7

    def next(self, ahead=False):
        self.n += 1
        self.now += self.step_ns(self.trial, self.n)
        return 7


def test_latencies_are_arrival_to_arrival_and_warmup_is_excluded():
    # warm-up trials are slow (1 s per token); then token n of a trial takes n ms
    runner = FakeRunner(lambda trial, n: 10**9 if trial < 2 else n * 10**6)
    latencies, trials = bench.decode_latencies(runner, [5, 6], 4, samples=10, warmup=2, clock=runner.clock)
    assert trials == 3 and runner.starts == 5  # ceil(10 / 4) timed trials after 2 warm-up trials
    assert latencies == [1_000_000, 2_000_000, 3_000_000, 4_000_000] * 3  # the prefill's token only starts the clock


def test_every_ttft_trial_prefills_the_whole_prompt():
    """The prefix cache would skip the whole chunks the trial before wrote: it is off while TTFT is timed, and as it
    was after."""
    import cullama

    runner = cullama.Llama.synthetic(TINY, device="cpu", max_seq_len=64, prefill_chunk=8).runner
    chunks, real = [], runner.backend.run
    runner.backend.run = lambda plan: (chunks.append(plan.name) if plan.name.startswith("prefill[") else None,
                                       real(plan))[1]
    bench.ttft(runner, list(range(3, 23)), trials=2, warmup=1)
    assert chunks == ["prefill[0:8]", "prefill[8:16]", "prefill[16:20]"] * 3
    assert runner.prefix_cache
    runner.start(list(range(3, 23)), bench.GREEDY)
    assert runner.reused == 16


def test_percentiles_throughput_and_ttft_on_known_latencies():
    # 100 tokens per trial, token n takes n ms: p50 50.5, p90 90.1, p99 99.01, max 100, mean 50.5
    runner = FakeRunner(lambda trial, n: n * 10**6, ttft_ns=3_000_000)
    seen = []
    result = bench.run(runner, TINY, lengths=[100], samples=200, warmup=1, prompt_len=4, ttft_trials=5,
                       bandwidth={"bytes_per_s": 1e12}, clock=runner.clock, progress=lambda *a: seen.append(a))
    s = result.summaries()[0]
    assert s["samples"] == 200 and s["trials"] == 2
    for key, want in [("p50_ms", 50.5), ("p90_ms", 90.1), ("p99_ms", 99.01), ("max_ms", 100), ("mean_ms", 50.5),
                      ("tokens_per_s", 1e3 / 50.5), ("ttft_p50_ms", 3), ("ttft_p99_ms", 3)]:
        assert s[key] == pytest.approx(want), key
    context = 4 + 101 / 2  # mean of the contexts 5..104 the decode steps attend over
    bytes_ = TINY.decode_weight_bytes() + 2 * TINY.num_layers * TINY.kv_dim * 2 * context
    assert s["gb_s"] == pytest.approx(bytes_ / 50.5e-3 / 1e9)
    assert s["pct_bandwidth"] == pytest.approx(100 * s["gb_s"] * 1e9 / 1e12)
    assert runner.starts == 3 + 6 and len(result.lengths[0].ttft_ns) == 5  # warm-up excluded from TTFT too
    assert [len(p) for p in runner.prompts] == [4] * 3 + [100] * 6  # TTFT prompts have L tokens
    assert all(3 <= t < TINY.vocab_size for p in runner.prompts for t in p)
    assert seen[-1] == (100, "ttft", 5, 5) and (100, "decode", 200, 200) in seen
    table = bench.format_table(result)
    assert "p99 ms" in table and "99.010" in table and "1.00 TB/s" in table


def test_cpu_result_has_no_bandwidth_percentage():
    runner = FakeRunner(lambda trial, n: 2 * 10**6)
    result = bench.run(runner, TINY, lengths=[3, 5], samples=10, warmup=0, prompt_len=2, clock=runner.clock)
    assert [s["pct_bandwidth"] for s in result.summaries()] == [None, None]
    assert [s["samples"] for s in result.summaries()] == [12, 10]
    assert "not measured" in bench.format_table(result)


def test_real_clock_sees_real_sleeps():
    import time
    runner = FakeRunner(lambda trial, n: 0)
    runner.next = lambda ahead=False: time.sleep(0.002)
    latencies, _ = bench.decode_latencies(runner, [3], 3, samples=3, warmup=0)
    assert len(latencies) == 3 and min(latencies) >= 2_000_000


def test_json_record(tmp_path):
    runner = FakeRunner(lambda trial, n: 10**6)
    result = bench.run(runner, TINY, lengths=[3], samples=6, warmup=1, prompt_len=2, clock=runner.clock,
                       extra_options={"command": {"device": "cpu"}})
    bench.write_json(result, tmp_path / "b.json", model="tiny (synthetic)")
    record = json.loads((tmp_path / "b.json").read_text())
    assert record["schema"] == bench.SCHEMA and record["model"] == "tiny (synthetic)"
    assert {"date", "cullama", "commit", "environment", "config", "options", "bandwidth",
            "decode_weight_bytes"} <= set(record)
    assert record["options"]["command"] == {"device": "cpu"} and record["options"]["samples"] == 6
    assert record["interrupted"] is False
    assert "python" in record["environment"] and record["bandwidth"] is None
    (r,) = record["results"]
    assert r["decode_ns"] == [10**6] * 6 and len(r["ttft_ns"]) == bench.DEFAULT_TTFT_TRIALS
    assert r["p99_ms"] == pytest.approx(1.0) and r["pct_bandwidth"] is None


@pytest.mark.parametrize("args,needle", [
    (["--lengths", "10,x"], "--lengths"), (["--lengths", ""], "--lengths"), (["--lengths", "0"], "--lengths"),
    (["--samples", "0"], "--samples"), (["--warmup", "-1"], "--warmup"), (["--prompt-len", "0"], "--prompt-len"),
    (["--lengths", "600", "--max-seq-len", "512"], "--max-seq-len"), (["--model", "m", "--synthetic", "tiny"], "not both"),
    (["--synthetic", "nope"], "unknown preset")])
def test_bad_options_are_one_line(args, needle):
    result = CliRunner().invoke(main, ["bench", "--device", "cpu", *args])
    assert result.exit_code == 2
    (line,) = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert needle in line and "Traceback" not in result.output


@pytest.mark.parametrize("value", ["-3", "0", "1", "99999999999"])
@pytest.mark.parametrize("model", ["synthetic", "stories260K"])
def test_a_context_out_of_range_blames_the_option_before_anything_loads(value, model, stories_dir, monkeypatch):
    from cullama import llama as llama_module

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before --max-seq-len was checked")

    monkeypatch.setattr(llama_module, "load_checkpoint", refuse)
    monkeypatch.setattr(llama_module.Llama, "synthetic", refuse)
    where = ["--synthetic", "tiny"] if model == "synthetic" else ["--model", str(stories_dir)]
    result = CliRunner().invoke(main, ["bench", "--device", "cpu", *where, "--max-seq-len", value, "--lengths", "2"])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"error: --max-seq-len must be an integer from 2 to 2147483647, got {value}\n"


# -- the bandwidth kernel ---------------------------------------------------------------------------
def test_bandwidth_twin_sums_the_buffer_as_float32():
    data = np.random.default_rng(0).random(4 * 37, dtype=np.float32)
    out = np.array([1.5], np.float32)
    twin.read_sum(data.view(np.uint32), 36, out)  # the last vector is not read
    assert out[0] == pytest.approx(1.5 + data[:144].sum(dtype=np.float64), rel=1e-6)


def test_bandwidth_kernel_compiles_without_spills():
    resources = compile_module(twin.SOURCE, (), "sm_90").resources
    assert set(resources) == {"read_sum"} and not resources["read_sum"].spills


@pytest.mark.gpu
@pytest.mark.parametrize("n_vec,grid", [(1, 1), (1001, 3), (1 << 22, 528)])
def test_gpu_read_sum(kernels, n_vec, grid):
    import cupy as cp

    data = np.random.default_rng().random(4 * n_vec, dtype=np.float32)
    out = np.zeros(1, np.float32)
    twin.read_sum(data, n_vec, out)
    d_out = poisoned(cp, 1, np.float32)
    d_out[...] = 0
    kernels.function(KernelSpec("bandwidth.cu", "read_sum"))((grid,), (256,), (cp.asarray(data), np.uint64(n_vec), d_out))
    np.testing.assert_allclose(d_out.get(), out, rtol=1e-4)
    measured = bench.measure_bandwidth(1 << 28, reps=2)
    if not FAKE_GPU:  # CULLAMA_FAKE_GPU=1 times NumPy twins on the CPU: a speed there says nothing of the GPU's
        assert measured["bytes_per_s"] > 1e11


# -- end to end on the CPU --------------------------------------------------------------------------
def test_bench_command_on_the_cpu(tmp_path):
    try:
        from cullama.llama import Llama
        Llama.synthetic("tiny", device="cpu", max_seq_len=16)
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"the CPU plan path is not importable yet: {type(exc).__name__}: {exc}")
    out = tmp_path / "out.json"
    result = CliRunner().invoke(main, ["bench", "--device", "cpu", "--lengths", "3,5", "--samples", "10",
                                       "--warmup", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = [l.split() for l in result.stdout.splitlines() if l.split() and l.split()[0] in ("3", "5")]
    assert [r[0] for r in rows] == ["3", "5"] and all(r[8] == "-" for r in rows)  # no % on the CPU
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and record["model"] == "tiny (synthetic)"
    assert [len(r["decode_ns"]) for r in record["results"]] == [12, 10]
    assert record["options"]["command"]["lengths"] == "3,5"


def test_overlap_is_recorded_and_ignored_on_the_cpu(tmp_path):
    out = tmp_path / "out.json"
    result = CliRunner().invoke(main, ["bench", "--device", "cpu", "--lengths", "3", "--samples", "4",
                                       "--warmup", "0", "--overlap", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "--overlap: the CPU has no kernel overlap; ignored" in result.stderr
    record = json.loads(out.read_text())
    assert record["options"]["overlap"] is False and record["options"]["command"]["overlap"] is True


# -- the record is never lost ---------------------------------------------------------------------------
SMALL_RUN = ["bench", "--device", "cpu", "--lengths", "3", "--samples", "3", "--warmup", "0"]


def unwritable_directory(tmp_path):
    """A directory this process cannot create files in (root ignores permission bits: /sys then)."""
    import tempfile

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    for directory in (locked, Path("/sys")):
        try:
            tempfile.TemporaryFile(dir=directory).close()
        except OSError:
            return directory
    pytest.skip("no directory here refuses a file to this process")


@pytest.mark.parametrize("where,needle", [("missing", "does not exist"), ("locked", "cannot write in"),
                                          ("file-parent", "does not exist"), ("directory", "is a directory"),
                                          ("empty", "needs a file name")])
def test_json_paths_that_cannot_be_written_are_refused_before_the_run(tmp_path, monkeypatch, where, needle):
    monkeypatch.setattr(bench, "run", lambda *a, **k: pytest.fail("the benchmark ran before --json was checked"))
    (tmp_path / "plain").write_text("")
    path = {"missing": lambda: tmp_path / "no" / "b.json", "locked": lambda: unwritable_directory(tmp_path) / "b.json",
            "file-parent": lambda: tmp_path / "plain" / "b.json", "directory": lambda: tmp_path,
            "empty": lambda: ""}[where]()
    result = CliRunner().invoke(main, [*SMALL_RUN, "--json", str(path)])
    assert result.exit_code == 2, result.output
    if where == "directory":  # click's own check (click.Path(dir_okay=False)); check_writable has it too
        assert "is a directory" in result.stderr
        with pytest.raises(bench.OptionError, match="is a directory"):
            bench.check_writable(path)
        return
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: --json ") and needle in line


def test_a_full_disk_at_the_end_keeps_the_samples(tmp_path, monkeypatch):
    import errno

    def full(target, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bench, "_write", full)
    monkeypatch.setenv("CULLAMA_CACHE", str(tmp_path / "cache"))  # the copy goes under cullama's cache
    monkeypatch.setattr(bench.tempfile, "tempdir", str(tmp_path / "system-temp"))  # never here
    result = CliRunner().invoke(main, [*SMALL_RUN, "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 1, result.output
    (line,) = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert "No space left on device" in line and "the record with every sample is in" in line
    saved = Path(line.rsplit(" ", 1)[1])
    assert saved.parent == tmp_path / "cache" / "bench"
    assert len(json.loads(saved.read_text())["results"][0]["decode_ns"]) == 3
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "system-temp").exists()


def test_where_neither_the_file_nor_the_cache_can_be_written_it_says_the_samples_are_lost(tmp_path, monkeypatch):
    import errno

    def full(target, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bench, "_write", full)
    (tmp_path / "cache").write_text("a file, not a directory")
    monkeypatch.setenv("CULLAMA_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(main, [*SMALL_RUN, "--json", str(tmp_path / "b.json")])
    assert result.exit_code == 1, result.output
    (line,) = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert line.endswith("the samples are lost") and f"nor a copy in {tmp_path / 'cache' / 'bench'}" in line


def test_write_json_replaces_the_file_whole(tmp_path):
    runner = FakeRunner(lambda trial, n: 10**6)
    result = bench.run(runner, TINY, lengths=[3], samples=3, warmup=0, prompt_len=2, clock=runner.clock)
    target = tmp_path / "b.json"
    target.write_text("old")
    bench.write_json(result, target)
    assert json.loads(target.read_text())["schema"] == bench.SCHEMA
    assert [p.name for p in tmp_path.iterdir()] == ["b.json"]  # no scratch file left beside it
    assert target.stat().st_mode & 0o644 == 0o644
    bench.write_json(result, "/dev/null")  # a device is written as it is, never replaced


def test_bench_ctrl_c_exits_130(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "run", interrupted)
    result = CliRunner().invoke(main, SMALL_RUN)
    assert result.exit_code == 130 and result.stderr.splitlines()[-1] == "interrupted"


def interrupt_at_length(monkeypatch, length):
    """KeyboardInterrupt when the protocol starts measuring `length`, as a Ctrl-C would raise it there."""
    real = bench.decode_latencies

    def decode_latencies(runner, prompt, n, *args, **kwargs):
        if n == length:
            raise KeyboardInterrupt
        return real(runner, prompt, n, *args, **kwargs)

    monkeypatch.setattr(bench, "decode_latencies", decode_latencies)


def test_bench_ctrl_c_keeps_the_lengths_that_finished(tmp_path, monkeypatch):
    interrupt_at_length(monkeypatch, 5)
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--device", "cpu", "--lengths", "3,5,7", "--samples", "3",
                                       "--warmup", "0", "--json", str(out)])
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-2:] == [f"wrote {out} (interrupted)", "interrupted"]
    record = json.loads(out.read_text())
    assert record["interrupted"] is True and record["options"]["lengths"] == [3, 5, 7]
    assert [r["length"] for r in record["results"]] == [3] and len(record["results"][0]["decode_ns"]) == 3
    lines = result.stdout.splitlines()
    assert lines[0].endswith(", interrupted") and [l.split()[0] for l in lines[3:]] == ["3"]  # the table so far


def test_auto_says_when_the_protocol_runs_on_the_cpu(monkeypatch):
    from cullama.runtime import device

    monkeypatch.setattr(device, "cuda_status", lambda: (False, "no NVIDIA GPU found"))
    result = CliRunner().invoke(main, ["bench", "--lengths", "3", "--samples", "3", "--warmup", "0"])
    assert result.exit_code == 0, result.output
    assert result.stderr.splitlines()[0] == \
        "note: running on the CPU: no NVIDIA GPU found (the tiny preset: --device cpu --synthetic tiny)"
