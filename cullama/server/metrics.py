"""The server's counters in the Prometheus text format (version 0.0.4), for GET /metrics.

Written here rather than with prometheus_client: three kinds of metric, fixed label sets and one
output format fit in these lines, and the serve extra stays FastAPI + uvicorn + pydantic. Updated from
the engine thread and the HTTP event loop, so every update and the rendering take one lock.
"""

from __future__ import annotations

import bisect
import threading

# Seconds. Time to first token spans a tiny model's prefill to a long queue; a decode step on a GPU is
# a few ms, on the CPU's NumPy twins tens of ms.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # rows of a batched decode step (--max-batch <= 64)
TOKEN_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # [len(bounds) + 1]: the last is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip((*map(_number, self.bounds), "+Inf"), self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        return out + [f"{name}_sum {_number(self.sum)}", f"{name}_count {self.count}"]


OUTCOMES = ("completed", "cancelled", "failed", "rejected", "invalid")
SPECULATIVE_METHODS = ("ngram", "draft")  # the `method` label of the speculative counters
# The speculative counters: (the statistic of Generation.speculative, metric name, help)
SPECULATIVE_COUNTERS = (
    ("steps", "cullama_speculative_steps_total",
     "Verify steps of speculative decoding (target passes after the prefill), by drafting method."),
    ("drafted", "cullama_speculative_draft_tokens_total", "Drafted tokens the verify steps checked."),
    ("accepted", "cullama_speculative_accepted_tokens_total",
     "Drafted tokens the verify steps accepted: acceptance = accepted / drafted, tokens per step = "
     "(accepted + steps) / steps."),
)


class Metrics:
    """Everything /metrics shows. `outcome` of a generation request: completed (ran to a finish
    reason), cancelled (its client went away, or the server stopped), failed (500), rejected (429 or
    503: the queue is full, the model is loading), invalid (any other 4xx)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of those, the prefix cache's (Generation.cached_tokens)
        self.generated_tokens = 0
        self.queue_depth = 0
        self.running = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.token_time = Histogram(TOKEN_BUCKETS)
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.running_requests = 0
        # {method: {"steps", "drafted", "accepted"}}: every generation's speculative statistics, summed
        self.speculative = {method: _speculative_zeros() for method in SPECULATIVE_METHODS}

    def count(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def set_load(self, queue_depth: int, running: int) -> None:
        with self._lock:
            self.queue_depth, self.running = queue_depth, running

    def decode_steps(self, rows: int, steps: int = 1) -> None:
        """`steps` decode steps of `rows` sequences each (a batched step; 1: a step of one)."""
        with self._lock:
            for _ in range(steps):
                self.batch_size.observe(rows)

    def set_running(self, requests: int) -> None:
        """Requests holding a sequence slot now (prefilling or decoding)."""
        with self._lock:
            self.running_requests = requests

    def prompt(self, tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += tokens

    def generated(self, tokens: int, first_token_s: float | None, token_s: list[float], cached: int = 0) -> None:
        """One generation's tokens and times, however it ended; no first token, no time to it. `cached`: its
        prompt tokens the prefix cache gave."""
        with self._lock:
            self.generated_tokens += tokens
            self.cached_tokens += cached
            if first_token_s is not None:
                self.ttft.observe(first_token_s)
            for t in token_s:
                self.token_time.observe(t)

    def speculated(self, stats: dict) -> None:
        """One generation's speculative statistics (Generation.speculative), however it ended."""
        with self._lock:
            totals = self.speculative.setdefault(stats["method"], _speculative_zeros())
            for stat in totals:
                totals[stat] += stats[stat]

    def render(self) -> str:
        with self._lock:
            blocks = [
                _metric("cullama_requests_total", "counter", "Generation requests by outcome.",
                        [f'cullama_requests_total{{outcome="{o}"}} {n}' for o, n in self.requests.items()]),
                _metric("cullama_prompt_tokens_total", "counter", "Prompt tokens of the generations started.",
                        [f"cullama_prompt_tokens_total {self.prompt_tokens}"]),
                _metric("cullama_prompt_tokens_cached_total", "counter",
                        "Prompt tokens taken from the prefix cache, not computed again (the answer is the same).",
                        [f"cullama_prompt_tokens_cached_total {self.cached_tokens}"]),
                _metric("cullama_generation_tokens_total", "counter", "Tokens generated, cancelled requests included.",
                        [f"cullama_generation_tokens_total {self.generated_tokens}"]),
                _metric("cullama_queue_depth", "gauge", "Requests waiting for the engine.",
                        [f"cullama_queue_depth {self.queue_depth}"]),
                _metric("cullama_generation_running", "gauge", "1 while the engine runs a generation.",
                        [f"cullama_generation_running {self.running}"]),
                _metric("cullama_running_requests", "gauge",
                        "Requests the engine runs now (prefilling or decoding; up to --max-batch).",
                        [f"cullama_running_requests {self.running_requests}"]),
                _metric("cullama_decode_batch_size", "histogram", "Sequences (rows) per decode step.",
                        self.batch_size.lines("cullama_decode_batch_size")),
                _metric("cullama_time_to_first_token_seconds", "histogram",
                        "Arrival to first token (queue wait and prefill).",
                        self.ttft.lines("cullama_time_to_first_token_seconds")),
                _metric("cullama_time_between_tokens_seconds", "histogram",
                        "The engine's time from one token to the next (Llama.stream's timings).",
                        self.token_time.lines("cullama_time_between_tokens_seconds")),
                *(_metric(name, "counter", help_text,
                          [f'{name}{{method="{m}"}} {totals[stat]}' for m, totals in self.speculative.items()])
                  for stat, name, help_text in SPECULATIVE_COUNTERS),
            ]
        return "".join(blocks)


def _speculative_zeros() -> dict[str, int]:
    return {stat: 0 for stat, _, _ in SPECULATIVE_COUNTERS}


def _metric(name: str, kind: str, help_text: str, samples: list[str]) -> str:
    return "\n".join([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]) + "\n"


def _number(value: float) -> str:
    return repr(float(value))
