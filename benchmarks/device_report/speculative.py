"""Speculative decoding (issue 9): the section and the targets of speculative.json, the record of
`cullama bench --speculative replay --draft-tokens 4` (cullama/bench/speculative.py's to_json); the verify
step's targets prefer decode.json's verify graph timings (benchmarks/decode_step.py) where it has them."""

from __future__ import annotations

from .values import DASH, as_dict, as_int, dicts, fmt, num, table
from .results import Results, unavailable

NAME = "speculative.json"
VERIFY_X_PLAIN = {4: 1.10, 8: 1.25}  # the verify step of k drafts against the plain step in the same run
VERIFY_CONTEXT = 500
REPLAY_K, REPLAY_MS = 4, 0.8  # replay (every draft accepted), k = 4: at most 0.8 ms per token


def _rows(record: dict) -> list[dict]:
    rows = [r for r in dicts(record.get("results")) if as_int(r.get("length")) is not None]
    return sorted(rows, key=lambda r: as_int(r["length"]))


def _verify_rows(record: dict) -> dict[int, dict]:
    rows = dicts(as_dict(record.get("verify")).get("rows"))
    return {as_int(r.get("k")): r for r in rows if as_int(r.get("k")) is not None}


def _batched(record: dict) -> bool:
    return as_dict(record.get("options")).get("verify") == "batched"


def section_speculative(res: Results) -> list[str]:
    rec = res.records[NAME]
    o = as_dict(rec.get("options"))
    verify = as_dict(rec.get("verify"))
    lines = [f"{rec.get('model', '?')} on {rec.get('device', '?')}: --speculative {o.get('method', '?')}, k="
             f"{o.get('draft_tokens', '?')}{' (adaptive)' if o.get('adaptive') else ''}, prompt "
             f"{o.get('prompt_len', '?')} tokens, >= {o.get('samples', '?')} token latencies per L (a burst's "
             f"tokens arrive together: 0 ms behind its first); verify: {o.get('verify', 'not recorded')}.", ""]
    rows = [[r["length"], r.get("samples", DASH), fmt(r.get("p50_ms")), fmt(r.get("p90_ms")), fmt(r.get("p99_ms")),
             fmt(r.get("max_ms")), fmt(r.get("mean_ms")), fmt(r.get("tokens_per_s"), 1), r.get("steps", DASH),
             fmt(r.get("tokens_per_step"), 2), f"{r.get('accepted', DASH)}/{r.get('drafted', DASH)}"]
            for r in _rows(rec)]
    lines += table(["L", "samples", "p50 ms", "p90 ms", "p99 ms", "max ms", "mean ms", "tok/s", "steps",
                    "tok/step", "accepted/drafted"], rows) if rows else ["*no rows (results is empty)*"]
    lines += ["", f"Verify step at {verify.get('context', '?')} tokens of context: one verify() call per rep, every "
                  "draft accepted; k = 0 is a plain next() in the same run.", ""]
    vrows = [[k, r.get("reps", DASH), fmt(r.get("p50_ms")), fmt(r.get("mean_ms")), fmt(r.get("x_plain"), 2),
              f"{r.get('all_accepted', DASH)}/{r.get('reps', DASH)}"] for k, r in sorted(_verify_rows(rec).items())]
    lines += table(["k", "reps", "p50 ms", "mean ms", "x plain", "all accepted"], vrows) if vrows else \
        ["*no verify rows*"]
    derived = dicts(rec.get("derived"))
    if derived:
        lines += ["", "Derived, not measured (the k = 4 verify p50 / tokens per step):", ""]
        lines += [f"- {fmt(d.get('tokens_per_step'), 2)} tokens/step ({d.get('source', '?')}): "
                  f"{fmt(d.get('implied_ms_per_token'))} ms per token" for d in derived]
    return lines


def target_verify(res: Results, k: int):
    """From decode.json's verify graph replays (benchmarks/decode_step.py) where it has them, else from
    speculative.json's verify() calls (the host round trip included); the sequential stand-in is never judged."""
    decode = as_dict(res.records.get("decode.json", {}).get("verify"))
    row = {as_int(r.get("k")): r for r in dicts(decode.get("rows"))}.get(k)
    if row is not None and num(row.get("x_plain")) is not None:
        x, context, source = num(row["x_plain"]), as_int(decode.get("context")), "decode.json, its graph replayed"
        step_ms = row.get("replay_ms")
    elif NAME in res.records:
        rec = res.records[NAME]
        if not _batched(rec):
            return None, (f"the {as_dict(rec.get('options')).get('verify', 'unrecorded')} verify was timed, not a "
                          "batched step")
        row = _verify_rows(rec).get(k)
        x = None if row is None else num(row.get("x_plain"))
        if x is None:
            return None, f"no k={k} verify time against the plain step"
        context, source = as_int(as_dict(rec.get("verify")).get("context")), "speculative.json, verify() calls"
        step_ms = row.get("p50_ms")
    else:
        return None, f"no verify rows in decode.json; {unavailable(res, NAME)}"
    where = "" if context == VERIFY_CONTEXT else f" (not the target's {VERIFY_CONTEXT})"
    return x <= VERIFY_X_PLAIN[k], (f"{x:.3f}x the plain step ({fmt(step_ms)} ms; {source}) at context "
                                    f"{context}{where}")


def target_replay(res: Results):
    if NAME not in res.records:
        return None, unavailable(res, NAME)
    rec = res.records[NAME]
    o = as_dict(rec.get("options"))
    if not _batched(rec):
        return None, f"the {o.get('verify', 'unrecorded')} verify was timed, not a batched step"
    if o.get("method") != "replay" or o.get("draft_tokens") != REPLAY_K or o.get("adaptive"):
        return None, f"speculative.json ran {o.get('method')} with k={o.get('draft_tokens')}, not replay with k={REPLAY_K}"
    vals = [(num(r.get("mean_ms")), r["length"]) for r in _rows(rec)]
    if not vals or any(v is None for v, _ in vals):
        return None, "mean ms per token missing"
    worst, at = max(vals)
    over = [L for v, L in vals if v > REPLAY_MS]
    return not over, (f"worst mean {worst:.3f} ms per token at L={at} (L {','.join(str(L) for _, L in vals)})"
                      + (f"; above {REPLAY_MS} at L={','.join(map(str, over))}" if over else ""))


TARGETS = [
    (f"verify step, k = 4, <= {VERIFY_X_PLAIN[4]}x the plain step at {VERIFY_CONTEXT} tokens of context",
     f"decode.json, {NAME}", lambda res: target_verify(res, 4)),
    (f"verify step, k = 8, <= {VERIFY_X_PLAIN[8]}x the plain step at {VERIFY_CONTEXT} tokens of context",
     f"decode.json, {NAME}", lambda res: target_verify(res, 8)),
    (f"replay (every draft accepted), k = {REPLAY_K}: <= {REPLAY_MS} ms per token", NAME, target_replay),
]
