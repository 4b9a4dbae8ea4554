"""The model families' shapes (issue 18): `cullama bench --synthetic llama3-8b` and `llama3.2-1b` (device_check.sh's
steps of those names), each against its own floor: the bytes its weights make a step read at the H200's 4.44 TB/s
(the record's weights.floor_ms_h200: 3.38 ms and 0.56 ms in FP16)."""

from __future__ import annotations

from .values import as_dict, num
from .results import Results, bench_results, not_from_a_gpu
from .run_sections import section_weights_bench

PRESETS = ("llama3-8b", "llama3.2-1b")
FLOOR_MARGIN = 1.10  # the target: p99 within 10 % of the preset's floor at every L


def floor_ms(record: dict) -> float | None:
    return num(as_dict(record.get("weights")).get("floor_ms_h200"))


def target(name: str):
    def judge(res: Results):
        if why := not_from_a_gpu(res, name):
            return None, why
        record = res.records[name]
        floor = floor_ms(record)
        vals = [(num(r.get("p99_ms")), r["length"]) for r in bench_results(record)]
        if floor is None or not vals or any(v is None for v, _ in vals):
            return None, f"{name}: the floor or a p99 is missing"
        worst, at = max(vals)
        return worst <= FLOOR_MARGIN * floor, (f"worst p99 {worst:.3f} ms at L={at}, {worst / floor:.2f}x the "
                                               f"floor {floor:.3f} ms")
    return judge


SECTIONS = [(f"bench_{name}.json", f"Model families: cullama bench --synthetic {name} (bench_{name}.json)",
             section_weights_bench(f"bench_{name}.json", lambda floor: floor * FLOOR_MARGIN)) for name in PRESETS]
TARGETS = [(f"{name}: p99 within {round((FLOOR_MARGIN - 1) * 100)} % of its floor at every L", f"bench_{name}.json",
            target(f"bench_{name}.json")) for name in PRESETS]
