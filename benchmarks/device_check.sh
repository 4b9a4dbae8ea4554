#!/usr/bin/env bash
# device_check.sh: everything worth running on a lent GPU machine, in one call (a 500 s budget, then the report).
#
#   bash benchmarks/device_check.sh          (from anywhere; on the device machine $OUT is set)
#
# Steps, most decisive first: install the package, `cullama info`, `cullama kernels --arch sm_90`,
# `pytest -m gpu`, `cullama bench`, `cullama bench --quantize int4` and `int8` and `cullama bench --overlap` at 10,
# 100 and 500 tokens, `cullama bench` on the llama3-8b and llama3.2-1b presets (issue 18: GQA 4, head_dim 64,
# a 128,256-id lm_head), then
# benchmarks/decode_step.py (plain vs overlapped graph), logprobs_step.py (what logprobs=N adds to a step),
# prefill_step.py (TTFT per prefill kernel pair),
# gemv_sweep.py, gemm_sweep.py (mma vs wgmma), the same two on INT4 / INT8 weights (gemv_mma.cu, gemm_quant.cu),
# the decode GEMVs per token-row count (gemv_sweep.py --rows, FP16 and W4 / W8),
# `cullama bench --speculative replay`, `cullama bench --json-schema` (issue 27: a constrained token against a plain
# one, target <= 1.05 at p50 and p99), serve_latency.py (what
# `cullama serve` adds per token), `cullama bench --batch` and serve_load.py (batched decode) and
# compare_hf.py --quick. Each step runs under `timeout` inside one overall
# budget (BUDGET_S, default 500 s), and a failing step does not stop the next. `pytest -m gpu` also runs the CPU
# executor against the GPU on the tensor-core kernels (tests/runtime/emu/test_emu_vs_gpu.py: emu_vs_gpu.json).
# ../shared (the test data beside the repo) is used when present; a copy carried as .shared otherwise.
# Under $OUT (the device tool returns at most 8 files): steps.log (every step's output), summary.txt,
# report.md and results.tgz (bench.json, bench_int4.json, bench_int8.json, bench_overlap.json, decode.json,
# prefill.json, gemv.json, gemm.json, gemv_quant.json, gemm_quant.json, compare.json, speculative.json,
# serve.json, emu_vs_gpu.json, logprobs.json, bench_llama3-8b.json, bench_llama3.2-1b.json, batch.json,
# serve_load.json, constrained.json;
# re-packed after every step, so a run cut short
# still returns what it finished). benchmarks/prepare_device.sh makes what to carry (.shared, .whl).
# Environment: PYTHON (default python3), SKIP_INSTALL=1 (already installed), BENCH_SAMPLES (default 300),
# BUDGET_S, STEPS (a comma list of step names: only those run, e.g. STEPS=pytest,int4 to rerun what failed;
# results.tgz then holds only their files, so keep the first run's).
# Last, benchmarks/summarize.py writes $OUT/report.md (Markdown for RESULTS.md: tables, targets, decisions);
# again by hand: python benchmarks/summarize.py "$OUT" (or results.tgz) [--markdown FILE].
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/cullama-device-check}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-500}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
LOG=$OUT/steps.log
SUMMARY=$OUT/summary.txt
RESULTS=$(mktemp -d)  # the JSON files, packed into $OUT/results.tgz after each step
: >"$LOG"
: >"$SUMMARY"
START=$SECONDS
CULLAMA=("$PY" -c 'from cullama.cli.main import main; main()')  # the `cullama` command, this Python's

left() { echo $((BUDGET_S - (SECONDS - START))); }

# step NAME CAP_S COMMAND...: run COMMAND under timeout (CAP_S, or what is left of the budget),
# its output appended to steps.log and shown; one line per step in summary.txt.
step() {
    local name=$1 cap=$2
    shift 2
    if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then
        return  # not selected
    fi
    local t
    t=$(left)
    ((cap < t)) && t=$cap
    if ((t < 15)); then
        printf '%-10s %-26s\n' "$name" "SKIPPED (out of time)" >>"$SUMMARY"
        return
    fi
    local shown="$*"
    echo "=== $name (timeout ${t}s): ${shown/"${CULLAMA[*]}"/cullama}" | tee -a "$LOG"
    local t0=$SECONDS
    timeout -k 5 "$t" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]} status=ok
    if ((rc == 124 || rc == 137)); then
        status="TIMEOUT (${t}s)"
    elif ((rc != 0)); then
        status="FAILED (exit $rc)"
    fi
    printf '%-10s %-26s %4ds\n' "$name" "$status" $((SECONDS - t0)) >>"$SUMMARY"
    tar -czf "$OUT/results.tgz" -C "$RESULTS" .
}

if [ -z "${CULLAMA_SHARED:-}" ] && [ ! -d ../shared ] && [ -d .shared ]; then
    export CULLAMA_SHARED=$PWD/.shared  # a copy carried to the device machine (see benchmarks/README.md)
fi
{
    echo "device_check: $(date -u +%Y-%m-%dT%H:%M:%SZ), budget ${BUDGET_S}s, python: $(command -v "$PY")"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --format=csv \
            --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw
    else echo "nvidia-smi: not available"; fi
    if [ -n "${CULLAMA_SHARED:-}" ]; then echo "test data: $CULLAMA_SHARED"
    elif [ -d ../shared ]; then echo "test data: ../shared"
    else echo "no test data (../shared, .shared): the tests that need it skip"; fi
} | tee -a "$LOG"

if [ "${SKIP_INSTALL:-0}" = 1 ]; then
    echo "install: skipped (SKIP_INSTALL=1)" | tee -a "$LOG"
else
    step install 120 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
    # the server's extra, from the wheels benchmarks/prepare_device.sh saved in .whl (the device has no network)
    if ! "$PY" -c 'import fastapi, uvicorn' 2>/dev/null && [ -d .whl ]; then
        step serve-deps 60 "$PY" -m pip install -q --no-index --find-links .whl 'fastapi>=0.115' 'uvicorn>=0.30' \
            'pydantic>=2.8'
    fi
    # constrained decoding's llguidance (the constrained extra; no PyTorch) and jsonschema (the GPU test of constrained
    # generation validates its JSON), from .whl too
    if ! "$PY" -c 'import llguidance, jsonschema' 2>/dev/null && [ -d .whl ]; then
        step grammar-deps 60 "$PY" -m pip install -q --no-index --find-links .whl 'llguidance>=1.7' 'jsonschema>=4'
    fi
fi
step info 30 "${CULLAMA[@]}" info
step kernels 100 "${CULLAMA[@]}" kernels --arch sm_90
# no -x: one run, every failure. -v names each test's outcome as it ends, so a run cut off by its cap still says
# which failed (the tracebacks come at the end); --durations: where the device's time went, for the next run's caps
CULLAMA_EMU_VS_GPU_JSON=$RESULTS/emu_vs_gpu.json step pytest 190 "$PY" -m pytest -m gpu -v --tb=short -rfEs \
    --durations=15 -p no:cacheprovider
step bench 90 "${CULLAMA[@]}" bench --json "$RESULTS/bench.json" --samples "${BENCH_SAMPLES:-300}"
# W4A16 / W8A16 decode end to end (issue 16: INT4 p99 <= 1.1 ms, INT8 <= 1.8 ms at every L)
step int4 50 "${CULLAMA[@]}" bench --quantize int4 --lengths 10,100,500 --samples 300 --json "$RESULTS/bench_int4.json"
step int8 50 "${CULLAMA[@]}" bench --quantize int8 --lengths 10,100,500 --samples 300 --json "$RESULTS/bench_int8.json"
step overlap 40 "${CULLAMA[@]}" bench --overlap --lengths 10,100,500 --samples 300 --json "$RESULTS/bench_overlap.json"
# LLaMA-3's shapes against their floors (15.01 GB a step, 3.38 ms; 2.47 GB, 0.56 ms; PREDICTIONS.md): a 4096-token
# cache is enough for L <= 500 and keeps the 1B's 131,072-token default from allocating 4.3 GB
for model in llama3-8b llama3.2-1b; do
    step "$model" 45 "${CULLAMA[@]}" bench --synthetic "$model" --lengths 10,100,500 --samples 200 --max-seq-len 4096 \
        --json "$RESULTS/bench_$model.json"
done
step decode 60 "$PY" benchmarks/decode_step.py --trials 2 --json "$RESULTS/decode.json"
step logprobs 30 "$PY" benchmarks/logprobs_step.py --trials 2 --steps 50 --json "$RESULTS/logprobs.json"
# Chunks 256 (one slot's) and 64 (a --max-batch model's on 7B FP16: plan.batch_prefill_chunk), then 512: TTFT per chunk
step prefill 60 "$PY" benchmarks/prefill_step.py --chunks 256,64,512 --json "$RESULTS/prefill.json"
step gemv 45 "$PY" benchmarks/gemv_sweep.py --json "$RESULTS/gemv.json"
step gemm 75 "$PY" benchmarks/gemm_sweep.py --rows 10,64,256 --json "$RESULTS/gemm.json"
# W4A16 / W8A16 (issue 16): the decode GEMVs per 7B shape in effective GB/s, and the prefill GEMM on quantized weights
step gemv-quant 45 "$PY" benchmarks/gemv_sweep.py --bits 4,8 --json "$RESULTS/gemv_quant.json"
step gemm-quant 40 "$PY" benchmarks/gemm_sweep.py --kernels mma-w4,mma-w8 --rows 10,256 --json \
    "$RESULTS/gemm_quant.json"
# Issue 26: the decode GEMVs per 7B shape at 1, 2, 5, 9 and 16 token rows (the plans' kernel for each count: decode,
# verify, batch), effective TB/s and the time against one row's (targets: >= 3.9-4.0 TB/s, 16 rows <= 1.15x one row)
step gemv-rows 40 "$PY" benchmarks/gemv_sweep.py --rows 1,2,5,9,16 --trials 10 --json "$RESULTS/gemv_rows.json"
step gemv-rows-quant 45 "$PY" benchmarks/gemv_sweep.py --bits 4,8 --rows 1,2,5,9,16 --trials 10 --json \
    "$RESULTS/gemv_rows_quant.json"
# Speculative decoding's upper bound (replay: every draft accepted) and its verify step per k; the derived figures
# use ngram's tokens per step on stories260K where the test data is here.
STORIES=${CULLAMA_SHARED:-../shared}/models/stories260K
LOOKUP=()
[ -d "$STORIES" ] && LOOKUP=(--acceptance-model "$STORIES")
step spec 40 "${CULLAMA[@]}" bench --speculative replay --draft-tokens 4 --lengths 100,500 --samples 500 \
    ${LOOKUP[@]+"${LOOKUP[@]}"} --json "$RESULTS/speculative.json"
TOKENIZER=${CULLAMA_SHARED:-../shared}/tokenizers/llama2/tokenizer.model
# Constrained decoding (issue 27): a token under a JSON schema (its mask computed while the forward runs) against a
# plain one, trial after trial, on LLaMA-2-7B's shape with LLaMA-2's tokenizer (32,000 ids)
step constrained 60 "${CULLAMA[@]}" bench --synthetic llama-2-7b --tokenizer "$TOKENIZER" \
    --json-schema benchmarks/person.schema.json --lengths 10,100,500 --samples 300 --json "$RESULTS/constrained.json"
step serve 45 "$PY" benchmarks/serve_latency.py --synthetic llama-2-7b --tokenizer "$TOKENIZER" --device cuda \
    --lengths 64,256 --requests 3 --json "$RESULTS/serve.json"
# Batched decode (issue 17): the step per batch size, then 1..16 streaming clients through serve --max-batch 8
step batch 40 "${CULLAMA[@]}" bench --batch 1,2,4,8,16 --samples 200 --json "$RESULTS/batch.json"
step load 60 "$PY" benchmarks/serve_load.py --synthetic llama-2-7b --tokenizer "$TOKENIZER" --device cuda \
    --concurrency 1,2,4,8,16 --tokens 64 --rounds 1 --max-batch 8 --json "$RESULTS/serve_load.json"
budget=$(($(left) - 30))  # compare_hf starts no new engine or length after this; it saves after each engine
((budget < 1)) && budget=1
step compare 300 "$PY" benchmarks/compare_hf.py --quick --json "$RESULTS/compare.json" --budget-s "$budget"

{
    echo
    echo "=== summary ($((SECONDS - START))s of ${BUDGET_S}s)"
    cat "$SUMMARY"
    echo "files under $OUT:"
    ls -l "$OUT"
    echo "in results.tgz:"
    tar -tzvf "$OUT/results.tgz"
} | tee -a "$LOG"
# The report: the tables, the issues' targets PASS/FAIL and the default-setting decisions, in Markdown.
timeout 60 "$PY" benchmarks/summarize.py "$OUT" --markdown "$OUT/report.md" >/dev/null 2>>"$LOG" ||
    echo "summarize.py failed: see the end of steps.log" | tee -a "$LOG"
