"""`cullama bench`: the latency benchmark of record (DESIGN.md §5). Parsing and printing only:
the protocol is cullama.bench.latency. Progress goes to stderr, the table to stdout, the record to --json."""

from __future__ import annotations

import sys

import click

from .common import (MODEL_HELP, PREFILL_CHUNK, QUANTIZE, REVISION, Command, NonEmptyPath, option_file, out,
                     require_stdout)


class BenchProgress:
    """One line per length on stderr; rewritten in place while it runs when stderr is a terminal."""

    def __init__(self):
        self.tty = sys.stderr.isatty()

    def __call__(self, length: int, phase: str, done: int, total: int) -> None:
        text = f"L={length:<4} {phase:<6} {done}/{total}"
        if self.tty:
            click.echo(f"\r{text:<40}", nl=done >= total and phase == "ttft", err=True)
        elif done >= total:
            click.echo(text, err=True)

    @staticmethod
    def note(text: str) -> None:
        click.echo(text, err=True)


@click.command(cls=Command)
@click.option("--model", "model_dir", type=NonEmptyPath(), help=MODEL_HELP)
@REVISION
@click.option("--synthetic", help="Random weights of a preset's shape, no download "
                                  "[default: llama-2-7b on a GPU, tiny on the CPU].")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--lengths", default="10,50,100,150,200,250,300,350,400,450,500", show_default=True,
              help="Decode lengths L (tokens generated per trial; also the TTFT prompt lengths).")
@click.option("--samples", default=1000, show_default=True, type=int, help="Decode latencies per length, at least.")
@click.option("--warmup", default=2, show_default=True, type=int, help="Untimed trials before each measurement.")
@click.option("--prompt-len", default=8, show_default=True, type=int, help="Prompt tokens before each decode trial.")
@click.option("--max-seq-len", type=int, help="Context to allocate (default: the model's).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write every sample and the environment here.")
@QUANTIZE
@PREFILL_CHUNK
@click.option("--overlap/--no-overlap", default=None,
              help="Link the decode graph's kernels by programmatic dependent launch (sm_90+) "
                   "[default: CULLAMA_OVERLAP=1 turns it on; off otherwise].")
@click.option("--batch", "batch_sizes", metavar="SIZES",
              help="Benchmark batched decoding instead: the step's p50/p99 and tokens/s per batch size (e.g. 1,2,4,8; "
                   "--samples steps each after --warmup).")
@click.option("--speculative", type=click.Choice(["ngram", "draft", "replay"]),
              help="Benchmark speculative decoding instead: latency between tokens (bursts included), tokens per "
                   "step, and the verify step's time per k against the plain step (replay: drafts the target's own "
                   "greedy continuation, every draft accepted).")
@click.option("--draft-tokens", type=int, help="--speculative: tokens drafted per step, 1 to 15 [default: 4].")
@click.option("--adaptive-draft", is_flag=True, help="--speculative: move --draft-tokens with the recent acceptance.")
@click.option("--draft-model", type=NonEmptyPath(),
              help="--speculative draft: the draft model's checkpoint directory (or hub id).")
@click.option("--verify-context", type=int, help="--speculative: context of the verify step timings [default: 500].")
@click.option("--verify-reps", type=int, help="--speculative: timed verify calls per k [default: 20].")
@click.option("--acceptance-model", type=NonEmptyPath(),
              help="--speculative: a real checkpoint (e.g. stories260K) on which ngram's tokens per step is measured "
                   "for the derived per-token figures.")
@click.option("--json-schema", "json_schema", metavar="FILE",
              help="Benchmark constrained decoding instead: per-token p50/p99 under the JSON schema in FILE against "
                   "plain decoding, trial after trial, and the host's time per mask.")
@click.option("--tokenizer", type=NonEmptyPath(),
              help="--json-schema: the tokenizer the grammar is matched with (default: the checkpoint's; --synthetic "
                   "has none: e.g. the LLaMA-2 tokenizer.model for llama-2-7b).")
def bench(model_dir, revision, synthetic, device, lengths, samples, warmup, prompt_len, max_seq_len, json_path,
          quantize, prefill_chunk, overlap, batch_sizes, json_schema, tokenizer, **speculative):
    """Per-token decode latency (p50/p90/p99/max), tokens/s, GB/s and TTFT at each length."""
    require_stdout()
    from ..bench import latency as protocol
    from ..model import hub
    from ..model.config import from_pretrained as read_config, preset
    from ..runtime.device import resolve
    from ..model.weights import config_layout
    from ..common.errors import PromptError
    from ..llama import Llama, check_draft, checked_context
    from ..runtime.plan import check_supported
    from ..text.tokenizer import find_tokenizer, load_tokenizer

    command = {"model": model_dir, "synthetic": synthetic, "device": device, "lengths": lengths,
               "samples": samples, "warmup": warmup, "prompt_len": prompt_len, "max_seq_len": max_seq_len,
               "json": json_path, "quantize": quantize, "prefill_chunk": prefill_chunk, "overlap": overlap,
               "json_schema": json_schema, "tokenizer": tokenizer, **speculative,
               **({"revision": revision} if revision is not None else {})}
    if model_dir is not None and synthetic is not None:
        raise PromptError("give either --model or --synthetic, not both")
    if revision is not None and model_dir is None:
        raise PromptError("--revision goes with --model")
    speculative_options(speculative)
    if json_schema is not None and (batch_sizes is not None or speculative["speculative"]):
        raise PromptError("--json-schema goes with neither --batch nor --speculative")
    sizes = None
    if batch_sizes is not None:
        from ..bench import batch as batch_bench
        from ..runtime.plan import MAX_SLOTS

        if speculative["speculative"]:
            raise PromptError("give either --batch or --speculative, not both")
        sizes = batch_bench.parse_sizes(batch_sizes, MAX_SLOTS)
    lengths = protocol.parse_lengths(lengths)
    if json_path is not None:
        protocol.check_writable(json_path)  # before the run, not after it
    fallback = []
    dev = resolve(device, on_fallback=fallback.append)
    if model_dir is None and synthetic is None:
        synthetic = "llama-2-7b" if dev == "cuda" else "tiny"
    if fallback:
        tiny = " (the tiny preset: --device cpu --synthetic tiny)" if synthetic == "tiny" else ""
        BenchProgress.note(f"note: {fallback[0]}{tiny}")
    local = None if model_dir is None else hub.resolve(model_dir, revision)  # a hub id: its snapshot (a download)
    if speculative["draft_model"] is not None:
        speculative["draft_model"] = hub.resolve(speculative["draft_model"], what="draft model")
    config = read_config(local) if local is not None else preset(synthetic)
    check_supported(config_layout(config, quantize).device)
    context = checked_context(config, max_seq_len)
    if sizes is not None:
        batch_bench.check_options(sizes, samples, warmup, prompt_len, context)
    else:
        protocol.check_options(lengths, samples, warmup, prompt_len, context)

    if speculative["speculative"]:
        check_speculative(speculative, context)
    constrained = None
    if json_schema is not None or tokenizer is not None:
        constrained = constrained_setup(json_schema, tokenizer, model_dir, config)
    if speculative["draft_model"] is not None:  # a draft that cannot speak the target's tokens, before any weight
        has_tokenizer = local is not None and find_tokenizer(local) is not None
        check_draft(speculative["draft_model"], config, load_tokenizer(local) if has_tokenizer else None)
    bandwidth = None
    if dev == "cuda" and not speculative["speculative"] and sizes is None and constrained is None:  # before the weights
        BenchProgress.note("measuring the read bandwidth of this GPU ...")
        bandwidth = protocol.measure_bandwidth()
    BenchProgress.note(f"loading {model_dir or 'synthetic ' + synthetic} on {dev} ...")
    slots = max(sizes) if sizes else 1
    if local is not None:
        llm = Llama.from_pretrained(local, device=dev, max_seq_len=max_seq_len, quantize=quantize, max_batch=slots,
                                    prefill_chunk=prefill_chunk)
    else:
        llm = Llama.synthetic(synthetic, device=dev, max_seq_len=max_seq_len, quantize=quantize, max_batch=slots,
                              prefill_chunk=prefill_chunk)

    overlapped = False
    if dev == "cuda":
        if overlap is not None:
            llm.runner.backend.set_overlap(overlap)
        overlapped = llm.runner.backend.overlap
    elif overlap:
        BenchProgress.note("--overlap: the CPU has no kernel overlap; ignored")
    label = model_dir or f"{synthetic} (synthetic)"
    if sizes is not None:
        return batch_report(llm, label, dev, overlapped, sizes, samples, warmup, prompt_len, json_path, command)
    if constrained is not None:
        return constrained_report(llm, label, dev, overlapped, constrained, lengths, samples, warmup, prompt_len,
                                  json_path, command)
    if speculative["speculative"]:
        return speculative_bench(llm, label, dev, lengths, samples, warmup, prompt_len, json_path,
                                 {"command": command, "overlap": overlapped}, **speculative_defaults(speculative))
    try:
        result = protocol.run(llm.runner, llm.config, lengths, samples, warmup, prompt_len, bandwidth=bandwidth,
                              device=dev, progress=BenchProgress(), layout=llm.layout,
                              extra_options={"command": command, "overlap": overlapped,
                                             "prefill_chunk": llm.runner.prefill_chunk})
    except protocol.Interrupted as stop:  # Ctrl-C: the lengths that finished are kept, then exit 130
        report(stop.result, label, dev, overlapped, json_path)
        raise
    report(result, label, dev, overlapped, json_path)


def batch_report(llm, label, dev, overlapped, sizes, steps, warmup, prompt_len, json_path, command) -> None:
    """`cullama bench --batch`: cullama.bench.batch's run, its table to stdout and its record to --json."""
    from ..bench import batch as batch_bench, latency as protocol
    from ..runtime.device import environment

    records = batch_bench.run(llm.runner, llm.config.vocab_size, sizes, steps, warmup, prompt_len, BenchProgress.note)
    overlap = ", overlap on" if overlapped else ""
    chunk = llm.runner.prefill_chunk
    out(batch_bench.format_table(records, f"cullama bench --batch: {label}, {dev}{overlap}, prompt {prompt_len}, "
                                          f"{steps} steps per size, prefill chunk {chunk}"))
    if json_path:
        protocol.write_record({"kind": "batch", "model": label, "device": dev, "environment": environment(),
                               "options": {"command": command, "overlap": overlapped, "prefill_chunk": chunk},
                               "sizes": records}, json_path)
        BenchProgress.note(f"wrote {json_path}")


def constrained_setup(json_schema, tokenizer, model_dir, config):
    """(the model's Grammars, the constraint) for --json-schema, compiled before any weight loads (one line, exit 2,
    for a file that cannot be read, a schema that cannot be enforced, no tokenizer)."""
    from ..common.errors import PromptError
    from ..text.grammar import Constraint, Grammars
    from ..text.tokenizer import find_tokenizer, load_tokenizer

    if json_schema is None:
        raise PromptError("--tokenizer goes with --json-schema")
    text = option_file(json_schema, "--json-schema")
    if tokenizer is None and (model_dir is None or find_tokenizer(model_dir) is None):
        raise PromptError("--json-schema needs a tokenizer: the checkpoint's, or --tokenizer PATH (--synthetic has "
                          "none)")
    tok = load_tokenizer(model_dir, override=tokenizer) if model_dir is not None else load_tokenizer(tokenizer)
    tok.check_fits(config.vocab_size)
    grammars = Grammars(tok, config.vocab_size, (*config.eos_token_ids, *tok.eos_ids))
    constraint = Constraint.json_schema(text)
    grammars.check(constraint)
    return grammars, constraint


def constrained_report(llm, label, dev, overlapped, constrained, lengths, samples, warmup, prompt_len, json_path,
                       command) -> None:
    """`cullama bench --json-schema`: cullama.bench.constrained's run, its table to stdout, its record to --json."""
    from ..bench import constrained as protocol, latency
    from ..runtime.device import environment

    grammars, constraint = constrained
    records = protocol.run(llm.runner, grammars, constraint, lengths, samples, warmup, prompt_len,
                           llm.config.vocab_size, progress=BenchProgress())
    target = "the GPU target, <= 1.05 at p50 and p99, is for a GPU run" if dev == "cpu" else \
        "target <= 1.05 at p50 and p99"
    out(protocol.format_table(records, f"cullama bench --json-schema: {label}, {dev}"
                                       f"{', overlap on' if overlapped else ''}; constrained / plain per token "
                                       f"({target})"))
    if json_path:
        latency.write_record({**latency.record_header(protocol.SCHEMA, dev, label, llm.config,
                                                      {"command": command, "overlap": overlapped}),
                              "schema_text": repr(constraint), "results": records}, json_path)
        BenchProgress.note(f"wrote {json_path}")


def report(result, label: str, dev: str, overlapped: bool, json_path: str | None) -> None:
    """The table to stdout and the record to --json, of a whole run or of the lengths an interrupted one
    finished."""
    from ..bench import latency as protocol

    gpu = ""
    if dev == "cuda":
        from ..runtime.device import environment
        gpu = f" ({environment().get('gpu')})"
    interrupted = ", interrupted" if result.interrupted else ""
    weights = f" in {result.weights.describe()}" if result.weights.quantized else ""
    title = f"cullama bench: {label}{weights}, {dev}{gpu}{', overlap on' if overlapped else ''}{interrupted}"
    out(protocol.format_table(result, title=title))
    if json_path:
        protocol.write_json(result, json_path, model=label)
        BenchProgress.note(f"wrote {json_path}{' (interrupted)' if result.interrupted else ''}")


def speculative_options(options: dict) -> None:
    """The --speculative family only goes with --speculative (and --draft-model only with draft)."""
    from ..common.errors import PromptError

    method = options["speculative"]
    given = [name for name, value in options.items() if name != "speculative" and value is not None and value is not False]
    if method is None and given:
        raise PromptError(f"--{given[0].replace('_', '-')} needs --speculative ngram|draft|replay")
    if (method == "draft") != (options["draft_model"] is not None):
        raise PromptError("--draft-model goes with --speculative draft, and --speculative draft needs it")


def speculative_defaults(options: dict) -> dict:
    """The --speculative family with its defaults filled in where not given."""
    from ..generation.speculative import DEFAULT_DRAFT_TOKENS
    from ..bench.speculative import DEFAULT_VERIFY_CONTEXT, DEFAULT_VERIFY_REPS

    defaults = {"draft_tokens": DEFAULT_DRAFT_TOKENS, "verify_context": DEFAULT_VERIFY_CONTEXT,
                "verify_reps": DEFAULT_VERIFY_REPS}
    return {name: defaults[name] if value is None and name in defaults else value for name, value in options.items()}


def check_speculative(options: dict, max_seq_len: int) -> None:
    """Option errors before any weight loads."""
    from ..bench.speculative import check_options

    o = speculative_defaults(options)
    check_options(o["speculative"], o["draft_tokens"], max_seq_len, o["verify_context"], o["verify_reps"])


def speculative_bench(llm, label, dev, lengths, samples, warmup, prompt_len, json_path, extra, *, speculative,
                      draft_tokens, adaptive_draft, draft_model, verify_context, verify_reps, acceptance_model):
    """`cullama bench --speculative`: cullama.bench.speculative's protocol, its report and record."""
    from ..bench import speculative as protocol
    from ..llama import Llama

    draft_runner = None
    if draft_model is not None:  # its vocabulary was checked against the target's before anything loaded
        draft_runner = Llama.from_pretrained(draft_model, device=dev, max_seq_len=llm.runner.max_seq_len).runner
    lookup = None
    if acceptance_model is not None:
        BenchProgress.note(f"measuring ngram's tokens per step on {acceptance_model} ...")
        real = Llama.from_pretrained(acceptance_model, device=dev)
        lookup = {"model": str(acceptance_model), **protocol.lookup_tokens_per_step(
            real.runner, real.config.bos_token_id, k=draft_tokens)}
    weights = f" in {llm.layout.describe()}" if llm.layout.quantized else ""
    title = f"cullama bench --speculative {speculative}: {label}{weights}, {dev}"
    try:
        result = protocol.run(llm.runner, llm.config, speculative, lengths, samples, warmup, prompt_len,
                              draft_tokens=draft_tokens, adaptive=adaptive_draft, draft_runner=draft_runner,
                              verify_context=verify_context, verify_reps=verify_reps, device=dev, lookup=lookup,
                              progress=BenchProgress(), extra_options=extra)
    except KeyboardInterrupt as stop:  # bench.Interrupted: the lengths that finished are kept, then exit 130
        result = getattr(stop, "result", None)
        if result is not None:
            out(protocol.format_report(result, title=f"{title}, interrupted"))
            if json_path:
                protocol.write_json(result, json_path, model=label)
                BenchProgress.note(f"wrote {json_path} (interrupted)")
        raise
    out(protocol.format_report(result, title=title))
    if json_path:
        protocol.write_json(result, json_path, model=label)
        BenchProgress.note(f"wrote {json_path}")
