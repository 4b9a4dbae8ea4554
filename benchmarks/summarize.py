"""Summarize a device check: the JSON files of benchmarks/device_check.sh as Markdown for RESULTS.md.

    python benchmarks/summarize.py RESULTS [--markdown FILE]

RESULTS is results.tgz, a directory holding the JSON files (or $OUT itself, holding results.tgz), or one of
the JSON files. The files: bench.json (`cullama bench`), bench_overlap.json (`cullama bench --overlap`),
bench_int4.json and bench_int8.json (`cullama bench --quantize int4|int8`),
decode.json (decode_step.py), prefill.json (prefill_step.py), gemv.json (gemv_sweep.py), gemm.json
(gemm_sweep.py), gemv_quant.json (gemv_sweep.py --bits 4,8), gemm_quant.json (gemm_sweep.py --kernels
mma-w4,mma-w8), compare.json (compare_hf.py), speculative.json (`cullama bench --speculative replay`),
serve.json (serve_latency.py), emu_vs_gpu.json (tests/runtime/emu/test_emu_vs_gpu.py) and bench_llama3-8b.json,
bench_llama3.2-1b.json (`cullama bench --synthetic` on those presets, each against its own floor), batch.json
(`cullama bench --batch`), serve_load.json (serve_load.py), gemv_rows.json and gemv_rows_quant.json
(gemv_sweep.py --rows 1,2,5,9,16, FP16 and --bits 4,8).
summary.txt and steps.log beside them are read too when present (each step's status; nvidia-smi's driver
and clocks). Prints one Markdown report, --markdown writes
it too: a header (date, commit, GPU, driver, CUDA runtime, CuPy, NVRTC, read bandwidth), one section per
file, the issues' targets (PASS / FAIL / - where data is missing) and the decisions the data supports, each
with its rule. Any file may be missing, cut short or odd: that is said in the report, never a traceback.
Exit 0 when a report was printed; 2, with one line on stderr, when RESULTS does not exist or holds none of
the files. Nothing here needs a GPU; cullama is imported only for the defaults of this checkout (the GEMV
variant, the prefill kernels and chunk), which the JSON files do not record.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from device_report.checks import SECTIONS as CHECK_SECTIONS
from device_report.families import SECTIONS as FAMILY_SECTIONS
from device_report.batching import SECTIONS as BATCH_SECTIONS
from device_report.gemv_rows import SECTIONS as GEMV_ROWS_SECTIONS
from device_report.decisions import decisions
from device_report.header import header
from device_report.kernel_sections import section_gemm, section_gemv, section_prefill
from device_report.quant_sections import section_gemm_quant, section_gemv_quant
from device_report.results import FILES, Results, load, missing_note
from device_report.run_sections import (section_bench, section_compare, section_decode, section_overlap,
                                        section_weights_bench)
from device_report.speculative import section_speculative
from device_report.targets import targets


SECTIONS = [
    ("bench.json", "cullama bench (bench.json)", section_bench),
    ("bench_overlap.json", "Overlap: cullama bench --overlap against bench.json (bench_overlap.json)", section_overlap),
    ("bench_int4.json", "INT4 decode: cullama bench --quantize int4 (bench_int4.json)",
     section_weights_bench("bench_int4.json")),
    ("bench_int8.json", "INT8 decode: cullama bench --quantize int8 (bench_int8.json)",
     section_weights_bench("bench_int8.json")),
    ("decode.json", "Decode step: plain vs overlapped graph, next() vs ahead (decode.json)", section_decode),
    ("prefill.json", "Prefill: TTFT per kernel pair and chunk (prefill.json)", section_prefill),
    ("gemv.json", "GEMV sweep (gemv.json)", section_gemv),
    ("gemm.json", "GEMM sweep: mma vs wgmma, split-K (gemm.json)", section_gemm),
    ("gemv_quant.json", "Quantized GEMVs: W4 and W8 per shape (gemv_quant.json)", section_gemv_quant),
    ("gemm_quant.json", "Quantized prefill GEMM: W4 and W8 (gemm_quant.json)", section_gemm_quant),
    *GEMV_ROWS_SECTIONS,
    ("compare.json", "cullama vs HuggingFace (compare.json)", section_compare),
    ("speculative.json", "Speculative decoding: cullama bench --speculative replay (speculative.json)",
     section_speculative),
    *CHECK_SECTIONS,
    *FAMILY_SECTIONS,
    *BATCH_SECTIONS,
]


def guarded(fn, *args) -> list[str]:
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - an odd file is reported, never a traceback
        return [f"*could not summarize: {type(exc).__name__}: {exc} (the file does not have the expected shape)*"]


def report(res: Results) -> str:
    lines = guarded(header, res)
    for name, title, fn in SECTIONS:
        lines += ["", f"### {title}", ""]
        lines += guarded(fn, res) if name in res.records else [missing_note(res, name)]
    lines += ["", "### Targets", ""] + targets(res)
    lines += ["", "### Decisions", ""] + decisions(res)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", metavar="RESULTS", help="results.tgz, or a directory of the JSON files")
    parser.add_argument("--markdown", metavar="FILE", help="write the report here too")
    args = parser.parse_args(argv)
    try:
        res = load(args.results)
    except FileNotFoundError:
        print(f"summarize: {args.results}: no such file or directory", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"summarize: {args.results}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if not res.present():
        why = f" ({res.archive_note})" if res.archive_note else ""
        print(f"summarize: {args.results} holds none of {', '.join(FILES)}{why}", file=sys.stderr)
        return 2
    text = report(res)
    sys.stdout.write(text)
    if args.markdown:
        try:
            Path(args.markdown).write_text(text)
        except OSError as exc:
            print(f"summarize: could not write {args.markdown}: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
