"""The replicas' Prometheus texts (each replica's /metrics, server/metrics.py's format) as one.

summed(): what one `cullama serve` would show for all of them, the same names and labels, so dashboards and alerts
read the whole deployment as they read one server: counters and histograms add up (a histogram's buckets too: every
replica has the same bounds), a gauge is the sum over the replicas (cullama_queue_depth: requests waiting anywhere;
cullama_running_requests: running anywhere; cullama_generation_running: engines running one).
labelled(): every replica's own series, each sample with `replica="<id>"` first among its labels, to see each one's
batch sizes, queue and latencies (and cullama_replica_info: its process and node).
Both start with cullama_replicas{state="answered"|"silent"}: the replicas whose text came, and those that did not.
"""

from __future__ import annotations

PER_REPLICA = ("cullama_replica_info",)  # families that name one replica: labelled() only


def replicas_block(answered: int, silent: int) -> list[str]:
    return ["# HELP cullama_replicas Replicas behind this address, by whether they answered for /metrics.",
            "# TYPE cullama_replicas gauge",
            f'cullama_replicas{{state="answered"}} {answered}',
            f'cullama_replicas{{state="silent"}} {silent}']


def families(text: str) -> list[tuple[str, list[str], list[tuple[str, str, str]]]]:
    """(family, its HELP and TYPE lines, its samples as (name, labels inside the braces, value)) in order."""
    out: list[tuple[str, list[str], list[tuple[str, str, str]]]] = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            family = line.split(" ", 3)[2]
            if not out or out[-1][0] != family:
                out.append((family, [], []))
            out[-1][1].append(line)
        elif line.strip() and not line.startswith("#") and out:
            metric, _, value = line.rpartition(" ")
            name, _, labels = metric.partition("{")
            out[-1][2].append((name, labels.removesuffix("}"), value))
    return out


def add(values: list[str]) -> str:
    """The sum of sample values, written as Prometheus reads them (integers stay integers)."""
    if all(v.lstrip("-").isdigit() for v in values):
        return str(sum(int(v) for v in values))
    return repr(sum(float(v) for v in values))


def summed(texts: list[str | None]) -> str:
    """One text for all the replicas' (None: a replica that did not answer)."""
    heads: dict[str, list[str]] = {}
    values: dict[str, dict[tuple[str, str], list[str]]] = {}  # family -> (name, labels) -> values, first-seen order
    for text in filter(None, texts):
        for family, head, samples in families(text):
            if family in PER_REPLICA:
                continue
            heads.setdefault(family, head)
            for name, labels, value in samples:
                values.setdefault(family, {}).setdefault((name, labels), []).append(value)
    lines = replicas_block(sum(t is not None for t in texts), sum(t is None for t in texts))
    for family, head in heads.items():
        lines += head
        lines += [f"{name}{{{labels}}} {add(v)}" if labels else f"{name} {add(v)}"
                  for (name, labels), v in values.get(family, {}).items()]
    return "\n".join(lines) + "\n"


def labelled(texts: dict[str, str | None]) -> str:
    """One text of every replica's own series ({replica id: its text, None where it did not answer})."""
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        for family, head, rows in families(text or ""):
            heads.setdefault(family, head)
            for name, labels, value in rows:
                tag = f'replica="{replica}"' + (f",{labels}" if labels else "")
                samples.setdefault(family, []).append(f"{name}{{{tag}}} {value}")
    answered = sum(t is not None for t in texts.values())
    lines = replicas_block(answered, len(texts) - answered)
    for family, head in heads.items():
        lines += head + samples.get(family, [])
    return "\n".join(lines) + "\n"
