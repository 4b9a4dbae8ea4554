"""cullama against HuggingFace transformers, in one process, on the same random LLaMA-2-7B FP16 weights.

    python benchmarks/compare_hf.py [--lengths 10,50,...] [--samples N] [--quick] [--json FILE]

cullama makes the weights once on the GPU (Llama.synthetic); they are copied into a transformers
LlamaForCausalLM of the same config (nothing on disk), and both engines' prompt logits are
compared. Peers: HF eager (DynamicCache) and HF static cache + torch.compile(mode="reduce-overhead"),
gpt-fast style (eager prefill; each decode step compiled, called after
torch.compiler.cudagraph_mark_step_begin(), its output cloned). Protocol as `cullama bench`
(DESIGN.md section 5): batch 1, greedy, EOS ignored; a token's latency is the host time from the
previous token's arrival to its own; trials until each L has --samples latencies; warm-up
excluded. One table: p50/p99 per L, ratio peer / cullama. Without torch/transformers, one line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import traceback

import numpy as np

from cullama.errors import CullamaError
from decode_step import parse_ints  # benchmarks/ is on sys.path when run as a script
from gemv_sweep import require_gpu

LENGTHS, QUICK_LENGTHS, QUICK_SAMPLES = [10] + list(range(50, 501, 50)), [10, 100, 500], 100
DEVICE = "cuda"  # where the HF peers run ("cpu" only in a test of this script's HF code)


def summary(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1e3
    p50, p90, p99 = (float(np.percentile(ms, q)) for q in (50, 90, 99))
    return {"n": len(ms), "p50": p50, "p90": p90, "p99": p99, "max": float(ms.max()), "mean": float(ms.mean())}


# -- the engines: generate(prompt ids, L) -> the L - 1 token latencies in seconds -----------------
def cullama_engine(llm):
    return lambda prompt, L: list(llm.generate(prompt, max_new_tokens=L, ignore_eos=True).timings.token_s)


def hf_model(llm, torch, transformers):
    """A transformers LlamaForCausalLM of llm's config, holding a copy of llm's device weights."""
    from cullama.checkpoint import EMBED, FINAL_NORM, LAYER_PLAN, LM_HEAD, expected_shapes, layer_name
    from cullama.engine import weight_buffer_name

    cfg = llm.config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(DEVICE):
            model = transformers.LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.eval().requires_grad_(False)
    shapes, params = expected_shapes(cfg), dict(model.named_parameters())
    plan = [(EMBED, "embed", 0), (FINAL_NORM, "final_norm", 0), (LM_HEAD, "lm_head", 0)]
    for i in range(cfg.num_layers):  # q|k|v and gate|up are row blocks of cullama's fused buffers
        for field, parts in LAYER_PLAN:
            rows = np.cumsum([0] + [shapes[layer_name(i, part)][0] for part in parts])
            plan += [(layer_name(i, part), weight_buffer_name(field, i), int(r)) for part, r in zip(parts, rows)]
    if missing := set(params) - {name for name, *_ in plan}:
        raise RuntimeError(f"HF parameters with no cullama buffer: {sorted(missing)[:3]}")
    llm.runner.backend.synchronize()
    arrays = llm.runner.backend.arrays
    with torch.no_grad():
        for name, buffer, row in plan:
            params[name].copy_(torch.from_dlpack(arrays[buffer][row:row + shapes[name][0]]).view(shapes[name]))
    torch.cuda.synchronize()
    return model


def decode_latencies(tok, step, L: int) -> list[float]:
    """Host latencies of L - 1 decode steps after the first token `tok`; step(tok) -> the next token."""
    tok.item()
    latencies, last = [], time.perf_counter()
    for _ in range(L - 1):
        tok = step(tok)
        tok.item()  # the token id has arrived on the host
        now = time.perf_counter()
        latencies.append(now - last)
        last = now
    return latencies


def hf_eager_engine(model, torch, transformers):
    @torch.no_grad()
    def generate(prompt, L):
        cache = transformers.DynamicCache()
        step = lambda ids: model(input_ids=ids, past_key_values=cache,  # noqa: E731
                                 use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        return decode_latencies(step(torch.tensor([prompt], device=DEVICE)), step, L)
    return generate


def hf_compiled_engine(model, torch, transformers, max_len: int, log):
    """Static cache + torch.compile(reduce-overhead) of one decode step; (generate, warm_up, step)."""
    old_api = "cache_position" in inspect.signature(model.forward).parameters  # gone in transformers 5.x
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)  # allocated at the prefill

    def model_step(ids, positions):  # called as it is for the prefill; compiled for a decode step
        extra = {"cache_position": positions} if old_api else {}
        return model(input_ids=ids, position_ids=positions[None], past_key_values=cache, use_cache=True,
                     **extra).logits[:, -1].argmax(-1, keepdim=True)

    step = {"fn": torch.compile(model_step, mode="reduce-overhead", fullgraph=True), "fullgraph": True}

    @torch.no_grad()
    def generate(prompt, L):
        cache.reset()
        first = model_step(torch.tensor([prompt], device=DEVICE), torch.arange(len(prompt), device=DEVICE))
        pos = torch.tensor([len(prompt)], device=DEVICE)

        def one(tok):
            torch.compiler.cudagraph_mark_step_begin()
            out = step["fn"](tok, pos).clone()  # the graph's output buffer is reused by the next replay
            pos.add_(1)  # after the replay copied pos into the graph's input, in stream order
            return out
        return decode_latencies(first, one, L)

    def warm_up(prompt, n):
        t0 = time.perf_counter()
        try:
            generate(prompt, n)
        except Exception as exc:  # noqa: BLE001 - a graph break somewhere in transformers
            log(f"  fullgraph=True failed ({type(exc).__name__}: {str(exc)[:160]!r}); trying fullgraph=False")
            torch._dynamo.reset()
            step.update(fn=torch.compile(model_step, mode="reduce-overhead", fullgraph=False), fullgraph=False)
            generate(prompt, n)
        log(f"  compiled (fullgraph={step['fullgraph']}) and warmed up in {time.perf_counter() - t0:.0f} s")
    return generate, warm_up, step


def hf_peers(llm, prompt, max_len, record, log) -> list:
    """The two HF engines on a copy of llm's weights, after checking that both compute the same logits."""
    try:
        import torch
        import transformers
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
    except Exception as exc:  # noqa: BLE001 - any reason at all: the peers are optional
        log(f"compare_hf: HuggingFace peers skipped: torch/transformers not usable ({type(exc).__name__}: {exc})")
        return []
    record["environment"].update(torch=torch.__version__, transformers=transformers.__version__)
    t0 = time.perf_counter()
    model = hf_model(llm, torch, transformers)
    ours = llm.logits(prompt)
    with torch.no_grad():
        theirs = model(torch.tensor([prompt], device=DEVICE), use_cache=False).logits[0].float().cpu().numpy()
    rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    record["weights_check"] = {"logits_max_rel_diff": rel, "top1_agreement": top1,
                               "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    log(f"HF model built and weights copied in {time.perf_counter() - t0:.0f} s; prompt logits: max |diff| / "
        f"max |HF| = {rel:.2e}, top-1 agreement {top1:.0%}" + ("" if rel < 2e-2 else "  WARNING: they differ"))
    compiled, warm_up, step = hf_compiled_engine(model, torch, transformers, max_len, log)
    record["hf_compile"] = step  # {"fn", "fullgraph"}; fn is dropped when the record is written
    return [("HF eager", hf_eager_engine(model, torch, transformers), None), ("HF static+compile", compiled, warm_up)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=parse_ints, help=f"generated tokens per trial (default {LENGTHS})")
    parser.add_argument("--samples", type=int, help="token latencies per length and engine (default 1000)")
    parser.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, {QUICK_SAMPLES} samples")
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=16, help="tokens of the untimed warm-up generation")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start nothing new after this")
    parser.add_argument("--json", metavar="FILE", help="every sample and the environment (after each engine)")
    args = parser.parse_args(argv)
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    samples = args.samples or (QUICK_SAMPLES if args.quick else 1000)
    if min(lengths) < 2 or args.prompt_len < 1:
        parser.error("each length must be at least 2 (a latency is between two tokens), --prompt-len >= 1")
    require_gpu("compare_hf")
    import cupy as cp

    from cullama import Llama
    from cullama.device import environment

    t_start, log = time.monotonic(), lambda text: print(text, flush=True)
    over_budget = lambda: time.monotonic() - t_start > args.budget_s  # noqa: E731
    max_len = args.prompt_len + max(lengths) + 1
    try:
        llm = Llama.synthetic("llama-2-7b", device="cuda", max_seq_len=max_len)
        cp.cuda.Device().synchronize()  # the random weights are written on the default stream
    except CullamaError as exc:
        sys.exit(f"compare_hf: {exc}")
    prompt = [1] + np.random.default_rng(0).integers(3, llm.config.vocab_size, args.prompt_len - 1).tolist()
    record = {"protocol": {"lengths": lengths, "samples": samples, "prompt": prompt, "warmup_tokens": args.warmup,
                           "latency": "host time from one token's arrival to the next, seconds"},
              "environment": environment(), "engines": {}}
    engines = [("cullama", cullama_engine(llm), None)]
    try:
        engines += hf_peers(llm, prompt, max_len, record, log)
    except Exception:  # noqa: BLE001 - cullama's numbers are still worth having
        log(f"HF peers: FAILED to set up: {traceback.format_exc().strip().splitlines()[-1]}")
        traceback.print_exc()
    for name, generate, warm_up in engines:
        results = record["engines"][name] = {}
        if over_budget():
            log(f"{name}: skipped, over the --budget-s")
            continue
        try:
            log(f"{name}: warming up")
            (warm_up or generate)(prompt, args.warmup)
            for L in lengths:
                if over_budget():
                    log(f"  {name}: over the --budget-s, lengths from {L} on skipped")
                    break
                latencies = []
                while len(latencies) < samples:
                    latencies += generate(prompt, L)
                results[L] = {**summary(latencies), "samples_s": latencies}
                log(f"  {name} L={L}: p50 {results[L]['p50']:.3f} ms, p99 {results[L]['p99']:.3f} ms "
                    f"({len(latencies)} tokens)")
        except Exception:  # noqa: BLE001 - one failing peer must not cost the others their numbers
            results["error"] = traceback.format_exc().strip().splitlines()[-1]
            log(f"{name}: FAILED: {results['error']}")
            traceback.print_exc()
        if args.json:  # after each engine: what was measured survives a later crash or timeout
            with open(args.json, "w") as f:
                json.dump(record, f, default=lambda o: None if callable(o) else str(o))
    print_table(record["engines"], lengths)
    return 0


def print_table(engines: dict, lengths: list[int]) -> None:
    base, peers = engines.get("cullama", {}), [n for n in engines if n != "cullama"]
    cell = lambda r, *keys: " ".join(f"{r[k]:>7.3f}" if r else f"{'-':>7}" for k in keys)  # noqa: E731
    print("\nper-token latency, ms (x = peer / cullama)\n    L | cullama p50     p99" +
          "".join(f" | {n:>17} p50     p99  x p50  x p99" for n in peers))
    for L in lengths:
        ours, line = base.get(L), f"{L:>5} | {cell(base.get(L), 'p50', 'p99'):>19}"
        for n in peers:
            r = engines[n].get(L)
            x = f"{r['p50'] / ours['p50']:>6.2f} {r['p99'] / ours['p99']:>6.2f}" if r and ours else f"{'-':>6} {'-':>6}"
            line += f" | {cell(r, 'p50', 'p99'):>29} {x}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
