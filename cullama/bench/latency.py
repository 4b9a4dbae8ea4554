"""The benchmark protocol of record (`cullama bench`, DESIGN.md §5), as a library.

For each L in `lengths`, batch 1, greedy, EOS ignored (a runner never stops by itself):
- decode: trials of `runner.start(prompt)` then L `runner.next(ahead=...)` calls, each queueing the
  following step before it waits, as `cullama generate` does; a token's latency is the
  host time from the previous token's arrival to its own (what a streaming user sees). The token
  that `start` returns is the prefill's, not a decode step's: it only starts the clock. Trials
  repeat until L has at least `samples` latencies; `warmup` trials before them are thrown away.
- TTFT: `runner.start` on an L-token prompt, timed `ttft_trials` times after `warmup` untimed ones.

    result = run(llm.runner, llm.config, lengths=(10, 100), samples=1000, bandwidth=measure_bandwidth())
    print(format_table(result)); write_json(result, "bench.json")

Achieved GB/s = the bytes a decode step reads (all linear weights and the lm_head as the device holds them:
FP16, or quantized codes and their (scale, zero) pairs; plus the K and V of every position attended, all of the
context or a sliding window's, averaged over the trial's steps) / the p50 latency.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import math
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..runtime import cache
from ..model.config import LlamaConfig
from ..common.errors import DeviceError, OptionError, PromptError, ResourceError
from ..model.layout import Layout, fp16
from ..runtime.sampling import SamplingParams

DEFAULT_LENGTHS = (10, *range(50, 501, 50))
DEFAULT_SAMPLES = 1000
DEFAULT_WARMUP = 2
DEFAULT_PROMPT_LEN = 8
DEFAULT_TTFT_TRIALS = 10
FIRST_ID = 3  # prompts avoid <unk>, <s>, </s>
SCHEMA = "cullama-bench/1"

Progress = Callable[[int, str, int, int], None]  # (L, "decode" | "ttft", done, total)
Clock = Callable[[], int]  # nanoseconds


@dataclasses.dataclass
class LengthResult:
    """Every measurement at one L (nanoseconds, warm-up excluded) and what they summarise to."""

    length: int
    decode_ns: list[int]  # trial after trial, L latencies each
    ttft_ns: list[int]
    trials: int
    bytes_per_step: float  # mean over the trial's contexts: weights + KV cache read

    def summary(self, bandwidth: float | None) -> dict:
        ms = np.asarray(self.decode_ns, dtype=np.float64) / 1e6
        p50, p90, p99 = np.percentile(ms, [50, 90, 99])
        gb_s = self.bytes_per_step / (p50 / 1e3) / 1e9
        ttft = np.asarray(self.ttft_ns, dtype=np.float64) / 1e6
        return {"length": self.length, "samples": len(self.decode_ns), "trials": self.trials,
                "p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99), "max_ms": float(ms.max()),
                "mean_ms": float(ms.mean()), "tokens_per_s": float(1e3 / ms.mean()), "gb_s": float(gb_s),
                "pct_bandwidth": 100 * gb_s * 1e9 / bandwidth if bandwidth else None,
                "ttft_p50_ms": float(np.percentile(ttft, 50)) if len(ttft) else None,
                "ttft_p99_ms": float(np.percentile(ttft, 99)) if len(ttft) else None}


@dataclasses.dataclass
class BenchResult:
    config: LlamaConfig
    device: str
    options: dict  # what was asked for: lengths, samples, warmup, prompt_len, ttft_trials, ...
    lengths: list[LengthResult]
    bandwidth: dict | None  # measure_bandwidth()'s record on a GPU; None on the CPU
    interrupted: bool = False  # Ctrl-C stopped the run: `lengths` are those that finished
    layout: Layout | None = None  # the weights' device layout (None: the config's FP16 layout)

    @property
    def weights(self) -> Layout:
        return self.layout or fp16(self.config)

    @property
    def read_bandwidth(self) -> float | None:
        return self.bandwidth["bytes_per_s"] if self.bandwidth else None

    def summaries(self) -> list[dict]:
        return [r.summary(self.read_bandwidth) for r in self.lengths]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during run(): `result` holds the lengths that finished, so that their samples can still be
    printed and recorded."""

    def __init__(self, result: BenchResult):
        super().__init__()
        self.result = result


# -- options --------------------------------------------------------------------------------------
def parse_lengths(text: str) -> tuple[int, ...]:
    """'10,50, 100' -> (10, 50, 100); PromptError naming --lengths otherwise."""
    parts = [p for p in text.replace(",", " ").split()]
    try:
        lengths = tuple(int(p) for p in parts)
    except ValueError:
        raise PromptError(f"--lengths {text!r} is not a comma-separated list of integers") from None
    if not lengths or min(lengths) < 1:
        raise PromptError(f"--lengths {text!r}: give one or more lengths, each >= 1")
    return lengths


def check_options(lengths: Sequence[int], samples: int, warmup: int, prompt_len: int, max_seq_len: int,
                  ttft_trials: int = DEFAULT_TTFT_TRIALS) -> None:
    """PromptError, one line naming the option, for a run that cannot be done."""
    if not lengths or min(lengths) < 1:
        raise PromptError(f"--lengths must be one or more integers >= 1, got {list(lengths)}")
    for name, value, low in (("--samples", samples, 1), ("--warmup", warmup, 0), ("--prompt-len", prompt_len, 1),
                             ("ttft_trials", ttft_trials, 1)):
        if not isinstance(value, int) or value < low:
            raise PromptError(f"{name} must be an integer >= {low}, got {value!r}")
    longest = max(lengths)
    if prompt_len + longest > max_seq_len or longest > max_seq_len:
        raise PromptError(f"--prompt-len {prompt_len} + the longest of --lengths ({longest}) does not fit "
                          f"in the context of {max_seq_len} (raise --max-seq-len)")


def prompt_ids(n: int, vocab_size: int, seed: int = 0) -> list[int]:
    """n deterministic random ids in [3, vocab): the same prompt in every run and on every device."""
    rng = np.random.default_rng(seed)
    return rng.integers(FIRST_ID, max(vocab_size, FIRST_ID + 1), size=n).tolist()


# -- measurements ---------------------------------------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, seed=0)


def trial(runner, prompt: Sequence[int], length: int, clock: Clock = time.perf_counter_ns, **start) -> list[int]:
    """One trial: start (with `start`'s keywords: a constrained trial's mask), then `length` next() calls, each
    queueing the following step before it waits; each token's latency (ns) from the previous token's arrival."""
    runner.start(prompt, GREEDY, **start)
    last = clock()  # the prefill's token arrived: the first decode step's clock starts here
    times = []
    for n in range(length):
        runner.next(ahead=n + 1 < length)  # as GenerationStream: the next step queued behind this one
        now = clock()
        times.append(now - last)
        last = now
    if hasattr(runner, "drain"):
        runner.drain()
    return times


def decode_latencies(runner, prompt: Sequence[int], length: int, samples: int, warmup: int,
                     clock: Clock = time.perf_counter_ns, progress: Progress | None = None) -> tuple[list[int], int]:
    """(latencies ns, timed trials): `warmup` + ceil(samples / length) trials of start + `length` next()."""
    trials = math.ceil(samples / length)
    latencies: list[int] = []
    for n in range(warmup + trials):
        times = trial(runner, prompt, length, clock)
        if n >= warmup:
            latencies.extend(times)
            if progress:
                progress(length, "decode", len(latencies), trials * length)
    return latencies, trials


def ttft(runner, prompt: Sequence[int], trials: int, warmup: int, clock: Clock = time.perf_counter_ns,
         progress: Progress | None = None) -> list[int]:
    """Nanoseconds from handing `runner.start` the prompt to holding the first token, `trials` times: every one a
    whole prefill (the prefix cache, which would skip the chunks the trial before wrote, is off meanwhile)."""
    out, cache = [], getattr(runner, "prefix_cache", False)
    runner.prefix_cache = False
    try:
        for trial in range(warmup + trials):
            t0 = clock()
            runner.start(prompt, GREEDY)
            t1 = clock()
            if trial >= warmup:
                out.append(t1 - t0)
                if progress:
                    progress(len(prompt), "ttft", len(out), trials)
    finally:
        runner.prefix_cache = cache
    return out


def step_bytes(config: LlamaConfig, context: float, layout: Layout | None = None) -> float:
    """Bytes one decode step reads when it attends to `context` cached positions: weights (in `layout`, default
    FP16: what Layout.decode_bytes counts), then K and V (FP16)."""
    return (layout or fp16(config)).decode_bytes() + 2 * config.num_layers * config.kv_dim * 2 * context


def run(runner, config: LlamaConfig, lengths: Sequence[int] = DEFAULT_LENGTHS, samples: int = DEFAULT_SAMPLES,
        warmup: int = DEFAULT_WARMUP, prompt_len: int = DEFAULT_PROMPT_LEN, ttft_trials: int = DEFAULT_TTFT_TRIALS,
        bandwidth: dict | None = None, device: str = "cpu", progress: Progress | None = None,
        clock: Clock = time.perf_counter_ns, extra_options: dict | None = None,
        layout: Layout | None = None) -> BenchResult:
    """The whole protocol on any runner with start/next (see the module docstring); `layout`: the weights' (for
    the bytes a step reads; default the config's FP16 layout). Ctrl-C raises Interrupted with the lengths that
    finished."""
    check_options(lengths, samples, warmup, prompt_len, runner.max_seq_len, ttft_trials)
    prompt = prompt_ids(prompt_len, config.vocab_size)
    options = {"lengths": list(lengths), "samples": samples, "warmup": warmup, "prompt_len": prompt_len,
               "ttft_trials": ttft_trials, "max_seq_len": runner.max_seq_len, **(extra_options or {})}
    results = []
    try:
        for length in lengths:
            gc.collect()  # start every length with nothing for the collector to find
            latencies, trials = decode_latencies(runner, prompt, length, samples, warmup, clock, progress)
            times = ttft(runner, prompt_ids(length, config.vocab_size, seed=length), ttft_trials, warmup, clock,
                         progress)
            # step i (1..L) attends over prompt_len + i positions (at most a sliding window's): their mean
            attended = np.minimum(prompt_len + np.arange(1, length + 1), config.sliding_window or np.inf).mean()
            results.append(LengthResult(length, latencies, times, trials, step_bytes(config, attended, layout)))
    except KeyboardInterrupt:
        raise Interrupted(BenchResult(config, device, options, results, bandwidth, interrupted=True,
                                      layout=layout)) from None
    return BenchResult(config, device, options, results, bandwidth, layout=layout)


def measure_bandwidth(buffer_bytes: int = 4 << 30, reps: int = 10) -> dict:
    """This GPU's HBM read bandwidth now: kernels_cu/bandwidth.cu over a few GiB, timed with CUDA
    events, best of `reps` (the ceiling a decode step could reach). Needs CuPy and a GPU."""
    import cupy as cp

    from ..runtime.registry import KernelLoader, KernelSpec

    free, _ = cp.cuda.runtime.memGetInfo()
    n_bytes = min(buffer_bytes, free // 4) // 16 * 16
    loader = KernelLoader()
    # Random data, not zeros: zeros can stream faster than real weights do (device METHOD.md).
    data = cp.empty(n_bytes // 2, dtype=np.float16)
    loader.function(KernelSpec("fill.cu", "fill_uniform"))(
        (1024,), (256,), (data, np.uint64(data.size), np.uint64(0), np.float32(0), np.float32(1)))
    out = cp.zeros(1, dtype=np.float32)
    kernel = loader.function(KernelSpec("bandwidth.cu", "read_sum"))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    grid, args = (8 * sms,), (data, np.uint64(n_bytes // 16), out)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    kernel(grid, (256,), args)  # warm-up: module load, clocks up
    seconds = []
    for _ in range(reps):
        start.record()
        kernel(grid, (256,), args)
        end.record()
        end.synchronize()
        seconds.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    del data, out
    cp.get_default_memory_pool().free_all_blocks()  # hand the buffer back before the weights arrive
    return {"bytes_per_s": n_bytes / min(seconds), "buffer_bytes": n_bytes, "reps_s": seconds,
            "statistic": "best of reps", "kernel": "bandwidth.cu:read_sum"}


# -- reports --------------------------------------------------------------------------------------
def git_commit() -> str | None:
    """The checkout's HEAD, or None where this is not a git checkout (an installed wheel)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                              capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def record_header(schema: str, device: str, model: str, config: LlamaConfig, options: dict) -> dict:
    """What a benchmark record starts with: its schema, the date, cullama, the commit, the environment, the
    device, the model and its config, and the options of the run."""
    from .. import __version__
    from ..runtime.device import environment

    return {
        "schema": schema,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cullama": __version__,
        "commit": git_commit(),
        "environment": environment(),
        "device": device,
        "model": model,
        "config": dataclasses.asdict(config),
        "options": options,
    }


def to_json(result: BenchResult, model: str | None = None) -> dict:
    """Every sample, the summaries and the environment: the record a reader can recompute from."""
    summaries = result.summaries()
    return {
        **record_header(SCHEMA, result.device, model or result.config.name, result.config, result.options),
        "decode_weight_bytes": result.weights.decode_bytes(),  # the weights' bytes a step reads, as stored
        "weights": result.weights.summary(),  # their format, and the floor they imply on an H200
        "bandwidth": result.bandwidth,
        "interrupted": result.interrupted,  # then "results" holds the lengths that finished, not all of options'
        "results": [{**s, "bytes_per_step": r.bytes_per_step, "decode_ns": r.decode_ns, "ttft_ns": r.ttft_ns}
                    for s, r in zip(summaries, result.lengths)],
    }


def check_writable(path: str | os.PathLike) -> None:
    """OptionError (--json) now, before a run, when the record could not be written at `path`: no name, a
    directory that does not exist or cannot be written, or a directory in its place. Creates and removes a
    scratch file beside it, the way write_json will write. A device or pipe (/dev/stdout) is written as it is,
    later."""
    if not os.fspath(path):  # Path("") would be the current directory
        raise OptionError("json", "needs a file name, not an empty one")
    target = Path(path)
    if target.is_dir():
        raise OptionError("json", f"{target} is a directory")
    if target.exists() and not target.is_file():
        return
    if not target.parent.is_dir():
        raise OptionError("json", f"{target}: the directory {target.parent} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"):
            pass
    except OSError as exc:
        raise OptionError("json", f"{target}: cannot write in {target.parent} ({exc.strerror or exc})") from None


def write_json(result: BenchResult, path: str | os.PathLike, model: str | None = None) -> None:
    write_record(to_json(result, model), path)


def write_record(record: dict, path: str | os.PathLike) -> None:
    """A benchmark record to `path`, through a temporary file beside it renamed into place (a failed write
    leaves no half-written file). When that fails (a full disk, say), the record goes to cullama's cache,
    `bench/` under ~/.cache/cullama (or $CULLAMA_CACHE), where cullama writes everything else, and a
    ResourceError says where: a finished run's samples are never lost."""
    text = json.dumps(record, indent=1) + "\n"
    target = Path(path)
    try:
        _write(target, text)
        return
    except OSError as exc:
        failure = f"cannot write {target} ({exc.strerror or exc})"
    try:
        fd, saved = tempfile.mkstemp(dir=cache.directory("bench"), prefix="cullama-bench-", suffix=".json")
        with os.fdopen(fd, "w") as file:
            file.write(text)
    except (OSError, DeviceError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ResourceError(f"{failure}, nor a copy in {cache.root() / 'bench'} ({why}): the samples are "
                            "lost") from None
    raise ResourceError(f"{failure}; the record with every sample is in {saved}")


def _write(target: Path, text: str) -> None:
    if target.exists() and not target.is_file():  # a device or a pipe: no file to replace
        with open(target, "w") as file:
            file.write(text)
        return
    fd, scratch = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # as a plain open() would make it (mkstemp makes 0600)
        with os.fdopen(fd, "w") as file:
            file.write(text)
        os.replace(scratch, target)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise


def _num(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def format_table(result: BenchResult, title: str | None = None) -> str:
    bw = result.read_bandwidth
    o = result.options
    lines = [title or f"cullama bench: {result.config.name} on {result.device}",
             f"prompt {o['prompt_len']} tokens, >= {o['samples']} decode latencies per L, {o['warmup']} warm-up "
             f"trials; read bandwidth {'%.2f TB/s (measured)' % (bw / 1e12) if bw else 'not measured (CPU)'}",
             f"{'L':>5} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} {'mean ms':>8} {'tok/s':>8} "
             f"{'GB/s':>8} {'% bw':>6} {'TTFT p50':>9} {'TTFT p99':>9}"]
    for s in result.summaries():
        lines.append(f"{s['length']:>5} {s['p50_ms']:>8.3f} {s['p90_ms']:>8.3f} {s['p99_ms']:>8.3f} "
                     f"{s['max_ms']:>8.3f} {s['mean_ms']:>8.3f} {s['tokens_per_s']:>8.1f} {s['gb_s']:>8.1f} "
                     f"{_num(s['pct_bandwidth'], 6, 1)} {_num(s['ttft_p50_ms'], 9, 3)} {_num(s['ttft_p99_ms'], 9, 3)}")
    return "\n".join(lines)
