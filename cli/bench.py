"""`cullama bench`: the latency benchmark of record (DESIGN.md §5). Parsing and printing only:
the protocol is cullama.bench. Progress goes to stderr, the table to stdout, the record to --json."""

from __future__ import annotations

import sys

import click

from .main import friendly_errors, main, out


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


@main.command()
@click.option("--model", "model_dir", type=click.Path(), help="HF LLaMA checkpoint directory.")
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
@click.option("--overlap/--no-overlap", default=None,
              help="Link the decode graph's kernels by programmatic dependent launch (sm_90+) "
                   "[default: CULLAMA_OVERLAP=1 turns it on; off otherwise].")
@friendly_errors
def bench(model_dir, synthetic, device, lengths, samples, warmup, prompt_len, max_seq_len, json_path, overlap):
    """Per-token decode latency (p50/p90/p99/max), tokens/s, GB/s and TTFT at each length."""
    from .. import bench as protocol
    from ..config import from_pretrained as read_config, preset
    from ..device import resolve
    from ..weights import device_config
    from ..errors import PromptError
    from ..llama import Llama
    from ..plan import check_supported

    command = {"model": model_dir, "synthetic": synthetic, "device": device, "lengths": lengths,
               "samples": samples, "warmup": warmup, "prompt_len": prompt_len, "max_seq_len": max_seq_len,
               "json": json_path, "overlap": overlap}
    if model_dir is not None and synthetic is not None:
        raise PromptError("give either --model or --synthetic, not both")
    lengths = protocol.parse_lengths(lengths)
    if json_path:
        protocol.check_writable(json_path)  # before the run, not after it
    fallback = []
    dev = resolve(device, on_fallback=fallback.append)
    if model_dir is None and synthetic is None:
        synthetic = "llama-2-7b" if dev == "cuda" else "tiny"
    if fallback:
        tiny = " (the tiny preset: --device cpu --synthetic tiny)" if synthetic == "tiny" else ""
        BenchProgress.note(f"note: {fallback[0]}{tiny}")
    config = read_config(model_dir) if model_dir is not None else preset(synthetic)
    check_supported(device_config(config))
    protocol.check_options(lengths, samples, warmup, prompt_len, max_seq_len or config.max_seq_len)

    bandwidth = None
    if dev == "cuda":  # before the weights arrive, so the buffer can be a few GiB on any GPU
        BenchProgress.note("measuring the read bandwidth of this GPU ...")
        bandwidth = protocol.measure_bandwidth()
    BenchProgress.note(f"loading {model_dir or 'synthetic ' + synthetic} on {dev} ...")
    if model_dir is not None:
        llm = Llama.from_pretrained(model_dir, device=dev, max_seq_len=max_seq_len)
    else:
        llm = Llama.synthetic(synthetic, device=dev, max_seq_len=max_seq_len)

    overlapped = False
    if dev == "cuda":
        if overlap is not None:
            llm.runner.backend.set_overlap(overlap)
        overlapped = llm.runner.backend.overlap
    elif overlap:
        BenchProgress.note("--overlap: the CPU has no kernel overlap; ignored")
    label = model_dir or f"{synthetic} (synthetic)"
    result = protocol.run(llm.runner, llm.config, lengths, samples, warmup, prompt_len, bandwidth=bandwidth,
                          device=dev, progress=BenchProgress(),
                          extra_options={"command": command, "overlap": overlapped})
    gpu = ""
    if dev == "cuda":
        from ..device import environment
        gpu = f" ({environment().get('gpu')})"
    title = f"cullama bench: {label}, {dev}{gpu}{', overlap on' if overlapped else ''}"
    out(protocol.format_table(result, title=title))
    if json_path:
        protocol.write_json(result, json_path, model=label)
        BenchProgress.note(f"wrote {json_path}")
