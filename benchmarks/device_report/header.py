"""The report's header: date, commit, GPU, driver, CuPy/NVRTC and read bandwidth, from the JSON files and steps.log."""

from __future__ import annotations

import datetime

from .values import DASH, cuda_version, tb_s
from .results import FILES, Results, bandwidth_of, env_of


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
    lines.append("- **read bandwidth** (cullama.bench.latency.measure_bandwidth, measured by each step): "
                 + (", ".join(f"{n.removesuffix('.json')} {tb_s(b)}" for n, b in bws) if bws else DASH))
    if "summary.txt" in res.side:
        lines.append(f"- **steps** (summary.txt): {steps_summary(res.side['summary.txt']) or DASH}")
    status = [f"{n} " + ("ok" if n in recs else res.problems.get(n, "missing")) for n in FILES]
    lines.append(f"- **files** ({res.source}): " + "; ".join(status))
    if res.archive_note:
        lines.append(f"- **archive**: {res.archive_note}")
    return lines
