"""cullama against HuggingFace transformers, in one process, on the same random LLaMA-2-7B FP16 weights.

    python benchmarks/compare_hf.py [--lengths 10,50,...] [--samples N] [--quick] [--json FILE]

cullama makes the weights on the GPU (Llama.synthetic); a transformers LlamaForCausalLM of the same
config gets a copy (nothing on disk), and the two engines' prompt logits are compared. Peers: HF
eager (DynamicCache) and HF static cache + torch.compile(mode="reduce-overhead") gpt-fast style
(eager prefill; each decode step compiled, called after torch.compiler.cudagraph_mark_step_begin(),
its output cloned). All are timed by `cullama bench`'s protocol (cullama.bench.latency.decode_latencies).
One table: p50/p99 per L, ratio peer / cullama. Without torch/transformers, one line says so.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import sys
import time
import traceback

import numpy as np

from cullama.bench import latency as bench
from cullama.common.errors import CullamaError
from gemv_sweep import require_gpu  # benchmarks/ is on sys.path when run as a script

QUICK_LENGTHS, QUICK_SAMPLES, QUICK_WARMUP = (10, 100, 500), 100, 1
DEVICE = "cuda"  # where the HF peers run ("cpu" only in a test of this script's HF code)


def hf_model(llm, torch, transformers):
    """A transformers LlamaForCausalLM of llm's config, holding a copy of llm's device weights."""
    from cullama.model.checkpoint import EMBED, FINAL_NORM, LM_HEAD, expected_shapes, layer_name
    from cullama.model.layout import LAYER_PLAN, buffer_name

    cfg = llm.config
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device(DEVICE):
            model = transformers.LlamaForCausalLM(hf_cfg).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(torch.float32)
    shapes, params = expected_shapes(cfg), dict(model.named_parameters())
    plan = [(EMBED, "embed", 0), (FINAL_NORM, "final_norm", 0), (LM_HEAD, "lm_head", 0)]
    for i in range(cfg.num_layers):  # q|k|v and gate|up are row blocks of cullama's fused buffers
        for field, parts in LAYER_PLAN:
            rows = np.cumsum([0] + [shapes[layer_name(i, part)][0] for part in parts])
            plan += [(layer_name(i, part), buffer_name(field, i), int(r)) for part, r in zip(parts, rows)]
    if missing := set(params) - {name for name, *_ in plan}:
        raise RuntimeError(f"HF parameters with no cullama buffer: {sorted(missing)[:3]}")
    llm.runner.backend.synchronize()
    for name, buffer, row in plan:  # device to device, through DLPack
        src = llm.runner.backend.arrays[buffer][row:row + shapes[name][0]]
        params[name].copy_(torch.from_dlpack(src).view(shapes[name]))
    torch.cuda.synchronize()
    return model


class HFEager:
    """transformers' eager decode (DynamicCache), behind the start/next protocol that cullama.bench.latency times."""

    def __init__(self, model, torch, transformers, max_seq_len: int):
        self.model, self.torch, self.transformers, self.max_seq_len = model, torch, transformers, max_seq_len

    def start(self, prompt, params) -> int:
        self.cache = self.transformers.DynamicCache()
        return self._step(self.torch.tensor([list(prompt)], device=DEVICE))

    def next(self, ahead: bool = False) -> int:  # transformers has no step queued ahead
        return self._step(self.tok)

    def _step(self, ids) -> int:
        logits = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True).logits
        self.tok = logits[:, -1].argmax(-1, keepdim=True)
        return int(self.tok.item())


class HFCompiled:
    """Static cache + torch.compile(mode="reduce-overhead") of one decode step, gpt-fast style; start/next."""

    def __init__(self, model, torch, transformers, max_seq_len: int, log):
        self.torch, self.max_seq_len, self.log = torch, max_seq_len, log
        old_api = "cache_position" in inspect.signature(model.forward).parameters  # gone in transformers 5.x
        cache = self.cache = transformers.StaticCache(config=model.config, max_cache_len=max_seq_len)

        def model_step(ids, positions):  # called as it is for the prefill; compiled for a decode step
            extra = {"cache_position": positions} if old_api else {}
            return model(input_ids=ids, position_ids=positions[None], past_key_values=cache, use_cache=True,
                         **extra).logits[:, -1].argmax(-1, keepdim=True)

        self.model_step, self.fullgraph = model_step, True
        self.compiled = torch.compile(model_step, mode="reduce-overhead", fullgraph=True)

    def start(self, prompt, params) -> int:
        self.cache.reset()
        ids, torch = list(prompt), self.torch
        self.tok = self.model_step(torch.tensor([ids], device=DEVICE), torch.arange(len(ids), device=DEVICE))
        self.pos = torch.tensor([len(ids)], device=DEVICE)
        return int(self.tok.item())

    def next(self, ahead: bool = False) -> int:  # gpt-fast style: reads each token back before the next step
        self.torch.compiler.cudagraph_mark_step_begin()
        self.tok = self.compiled(self.tok, self.pos).clone()  # the graph's output buffer is reused by the next replay
        self.pos.add_(1)  # after the replay copied pos into the graph's input, in stream order
        return int(self.tok.item())

    def warm_up(self, prompt, n: int) -> None:
        """Compile, record the CUDA graph; where transformers breaks the graph, again with fullgraph=False."""
        t0 = time.perf_counter()
        try:
            warm_up(self, prompt, n)
        except Exception as exc:  # noqa: BLE001
            self.log(f"  fullgraph=True failed ({type(exc).__name__}: {str(exc)[:160]!r}); trying fullgraph=False")
            self.torch._dynamo.reset()
            self.compiled, self.fullgraph = self.torch.compile(self.model_step, mode="reduce-overhead"), False
            warm_up(self, prompt, n)
        self.log(f"  compiled (fullgraph={self.fullgraph}) and warmed up in {time.perf_counter() - t0:.0f} s")


def warm_up(runner, prompt, n: int) -> None:
    runner.start(prompt, bench.GREEDY)
    for _ in range(n):
        runner.next()


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
    torch.set_grad_enabled(False)
    record["environment"].update(torch=torch.__version__, transformers=transformers.__version__)
    t0 = time.perf_counter()
    model = hf_model(llm, torch, transformers)
    ours = llm.logits(prompt)
    theirs = model(torch.tensor([prompt], device=DEVICE), use_cache=False).logits[0].float().cpu().numpy()
    rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    top1 = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    record["weights_check"] = {"logits_max_rel_diff": rel, "top1_agreement": top1,
                               "attn_implementation": getattr(model.config, "_attn_implementation", None)}
    log(f"HF model built and weights copied in {time.perf_counter() - t0:.0f} s; prompt logits: max |diff| / "
        f"max |HF| = {rel:.2e}, top-1 agreement {top1:.0%}" + ("" if rel < 2e-2 else "  WARNING: they differ"))
    return [("HF eager", HFEager(model, torch, transformers, max_len)),
            ("HF static+compile", HFCompiled(model, torch, transformers, max_len, log))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", help=f"decode lengths L (default {','.join(map(str, bench.DEFAULT_LENGTHS))})")
    parser.add_argument("--samples", type=int, help=f"latencies per L and engine (default {bench.DEFAULT_SAMPLES})")
    parser.add_argument("--warmup", type=int, help=f"untimed trials per L (default {bench.DEFAULT_WARMUP})")
    parser.add_argument("--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, {QUICK_SAMPLES} samples, "
                                                             f"{QUICK_WARMUP} warm-up trial (the device check)")
    parser.add_argument("--prompt-len", type=int, default=bench.DEFAULT_PROMPT_LEN)
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no new engine or L after this")
    parser.add_argument("--json", metavar="FILE", help="every sample and the environment (after each engine)")
    args = parser.parse_args(argv)
    samples = args.samples or (QUICK_SAMPLES if args.quick else bench.DEFAULT_SAMPLES)
    warmup = args.warmup if args.warmup is not None else QUICK_WARMUP if args.quick else bench.DEFAULT_WARMUP
    try:
        lengths = bench.parse_lengths(args.lengths) if args.lengths else (
            QUICK_LENGTHS if args.quick else bench.DEFAULT_LENGTHS)
        max_len = args.prompt_len + max(lengths) + 1
        bench.check_options(lengths, samples, warmup, args.prompt_len, max_len)
    except CullamaError as exc:
        parser.error(str(exc))
    require_gpu("compare_hf")
    import cupy as cp

    from cullama import Llama
    from cullama.runtime.device import environment

    t_start, log = time.monotonic(), lambda text: print(text, flush=True)
    over_budget = lambda: time.monotonic() - t_start > args.budget_s  # noqa: E731
    try:
        bandwidth = bench.measure_bandwidth()  # before the weights arrive: the buffer is a few GiB
        llm = Llama.synthetic("llama-2-7b", device="cuda", max_seq_len=max_len)
        cp.cuda.Device().synchronize()  # the random weights are written on the default stream
    except CullamaError as exc:
        sys.exit(f"compare_hf: {exc}")
    prompt = bench.prompt_ids(args.prompt_len, llm.config.vocab_size)
    record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": bench.git_commit(), "cullama_overlap": llm.runner.backend.overlap,
              "protocol": {"lengths": list(lengths), "samples": samples, "warmup": warmup, "prompt": prompt},
              "bandwidth": bandwidth, "environment": environment(), "engines": {}}
    engines = [("cullama", llm.runner)]
    try:
        engines += hf_peers(llm, prompt, max_len, record, log)
    except Exception:  # noqa: BLE001 - cullama's numbers are still worth having
        log(f"HF peers: FAILED to set up: {traceback.format_exc().strip().splitlines()[-1]}")
        traceback.print_exc()
    for name, runner in engines:
        results = record["engines"][name] = {}
        if over_budget():
            results["skipped"] = "over the --budget-s"
            log(f"{name}: skipped, over the --budget-s")
            continue
        try:
            log(f"{name}: warming up")  # with at most max(lengths) tokens: the context every engine has
            n = min(16, max(lengths))
            runner.warm_up(prompt, n) if isinstance(runner, HFCompiled) else warm_up(runner, prompt, n)
            for L in lengths:
                if over_budget():
                    results["skipped"] = f"lengths from {L} on: over the --budget-s"
                    log(f"  {name}: over the --budget-s, lengths from {L} on skipped")
                    break
                ns, trials = bench.decode_latencies(runner, prompt, L, samples, warmup)
                kv_context = len(prompt) + (L + 1) / 2  # as cullama bench counts the bytes of a step
                r = bench.LengthResult(L, ns, [], trials, bench.step_bytes(llm.config, kv_context))
                results[L] = {**r.summary(bandwidth["bytes_per_s"]), "decode_ns": ns}
                log(f"  {name} L={L}: p50 {results[L]['p50_ms']:.3f} ms, p99 {results[L]['p99_ms']:.3f} ms "
                    f"({len(ns)} tokens)")
        except Exception:  # noqa: BLE001 - one failing peer must not cost the others their numbers
            results["error"] = traceback.format_exc().strip().splitlines()[-1]
            log(f"{name}: FAILED: {results['error']}")
            traceback.print_exc()
        if isinstance(runner, HFCompiled):
            results["fullgraph"] = runner.fullgraph
        if args.json:  # after each engine: what was measured survives a later crash or timeout
            with open(args.json, "w") as f:
                json.dump(record, f)
    print_table(record["engines"], lengths)
    return 0


def print_table(engines: dict, lengths) -> None:
    base, peers = engines.get("cullama", {}), [n for n in engines if n != "cullama"]
    cell = lambda r: f"{r['p50_ms']:>7.3f} {r['p99_ms']:>7.3f}" if r else f"{'-':>7} {'-':>7}"  # noqa: E731
    print("\nper-token latency, ms (x = peer / cullama)\n    L | cullama p50     p99" +
          "".join(f" | {n:>17} p50     p99  x p50  x p99" for n in peers))
    for L in lengths:
        ours, line = base.get(L), f"{L:>5} | {cell(base.get(L)):>19}"
        for n in peers:
            r = engines[n].get(L)
            x = (f"{r['p50_ms'] / ours['p50_ms']:>6.2f} {r['p99_ms'] / ours['p99_ms']:>6.2f}" if r and ours
                 else f"{'-':>6} {'-':>6}")
            line += f" | {cell(r):>29} {x}"
        print(line)


if __name__ == "__main__":
    sys.exit(main())
