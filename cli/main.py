"""`cullama` commands. Parsing and printing only: the work is done by the library.

Any CullamaError becomes one line on stderr (`error: ...`) and exit code 2; Ctrl-C stops a
generation cleanly, keeps what was printed and exits with 130.
"""

from __future__ import annotations

import functools
import json
import sys

import click

from .. import __version__
from ..errors import CullamaError


def friendly_errors(command):
    """Turn a CullamaError into one line and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except CullamaError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)

    return wrapper


class LoadProgress:
    """A progress bar on stderr while the weights load (hidden when stderr is not a terminal)."""

    def __init__(self, label: str):
        self.label, self.bar, self.done = label, None, 0

    def __call__(self, done: int, total: int) -> None:
        if not sys.stderr.isatty():
            return
        if self.bar is None:
            self.bar = click.progressbar(length=max(total, 1), label=self.label, file=sys.stderr,
                                         show_percent=True, show_eta=False)
            self.bar.__enter__()
        self.bar.update(done - self.done)
        self.done = done
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="cullama")
def main():
    """cullama: LLaMA-2 inference with hand-written CUDA kernels, lowest latency at batch size 1."""


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a list of integers", param_hint="--prompt-ids") from None


def shared_options(command):
    """The options `generate` and `chat` share: the model, the device and the sampling."""
    options = [
        click.option("--model", "model_dir", required=True, type=click.Path(), help="HF LLaMA checkpoint directory."),
        click.option("--max-new-tokens", default=256, show_default=True, type=int),
        click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy."),
        click.option("--top-k", default=0, show_default=True, type=int, help="0 = off."),
        click.option("--top-p", default=1.0, show_default=True, type=float, help="1 = off."),
        click.option("--repetition-penalty", default=1.0, show_default=True, type=float),
        click.option("--seed", type=int, help="Seed for sampling (reproducible); random when omitted."),
        click.option("--stop", multiple=True, help="Stop when this text appears (repeatable)."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token."),
        click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"])),
        click.option("--max-seq-len", type=int, help="Context to allocate (default: the model's)."),
        click.option("--tokenizer", type=click.Path(), help="tokenizer.model to use instead of the checkpoint's."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON: ids, text, finish reason, timings."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def load(model_dir, device, max_seq_len, tokenizer):
    """The model, with a progress bar while the weights load and its notes said once."""
    from ..llama import Llama

    progress = LoadProgress("loading weights")
    try:
        llm = Llama.from_pretrained(model_dir, device=device, max_seq_len=max_seq_len, tokenizer=tokenizer,
                                    progress=progress)
    finally:
        progress.close()
    for note in llm.notes:
        click.echo(f"note: {note}", err=True)
    return llm


def stream_out(stream, as_json: bool) -> None:
    """Print the pieces as they become final; Ctrl-C keeps what was printed and exits with 130."""
    try:
        for piece in stream:
            if not as_json:
                click.echo(piece, nl=False)
    except KeyboardInterrupt:
        if not as_json:
            click.echo("")
        click.echo("interrupted", err=True)
        sys.exit(130)


def sampling(kwargs: dict) -> dict:
    keys = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "stop", "ignore_eos")
    return {k: kwargs[k] for k in keys}


@main.command()
@shared_options
@click.argument("prompt", required=False)
@click.option("--prompt-ids", help="Token ids instead of text, e.g. '1,450,7483'.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the LLaMA-2 chat template.")
@click.option("--system", help="System prompt for --chat.")
@friendly_errors
def generate(model_dir, prompt, prompt_ids, chat, system, device, max_seq_len, tokenizer, as_json, **kwargs):
    """Generate text from PROMPT (or standard input; an empty prompt starts from BOS alone)."""
    from ..errors import PromptError

    if prompt is not None and prompt_ids is not None:
        raise PromptError("give either PROMPT or --prompt-ids, not both")
    if system is not None and not chat:
        raise PromptError("--system needs --chat")
    if prompt is None and prompt_ids is None:
        prompt = "" if sys.stdin is None or sys.stdin.isatty() else sys.stdin.read().rstrip("\n")

    llm = load(model_dir, device, max_seq_len, tokenizer)
    if prompt_ids is not None:
        request = parse_ids(prompt_ids)
    elif chat:
        request = llm.chat_ids([{"role": "user", "content": prompt}], system=system)
    else:
        request = prompt
    stream = llm.stream(request, **sampling(kwargs))
    stream_out(stream, as_json)
    result = stream.result
    if as_json:
        click.echo(json.dumps({**result.to_dict(), "device": llm.device}))
    elif llm.tokenizer is None:
        click.echo(" ".join(map(str, result.token_ids)))
    else:
        click.echo("")


@main.command()
@shared_options
@click.option("--system", help="System prompt for the whole conversation.")
@friendly_errors
def chat(model_dir, system, device, max_seq_len, tokenizer, as_json, **kwargs):
    """A multi-turn LLaMA-2 chat: each line of standard input is a user turn; replies stream back.

    The whole conversation goes through the chat template at every turn; an empty line is skipped,
    end of input ends the conversation."""
    llm = load(model_dir, device, max_seq_len, tokenizer)
    interactive = sys.stdin is not None and sys.stdin.isatty()
    messages: list[dict] = []
    while True:
        if interactive:
            click.echo("> ", nl=False, err=True)
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.strip()})
        # Each turn's prompt starts with the last one's: only the new tokens are prefilled.
        stream = llm.stream(llm.chat_ids(messages, system=system), reuse_cache=True, **sampling(kwargs))
        stream_out(stream, as_json)
        result = stream.result
        messages.append({"role": "assistant", "content": result.text})
        click.echo(json.dumps({**result.to_dict(), "device": llm.device}) if as_json else "")


@main.command()
@click.option("--model", "model_dir", required=True, type=click.Path(), help="HF LLaMA checkpoint directory.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback: this machine only).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0 = any free port.")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--max-seq-len", type=int, help="Context to allocate (default: the model's).")
@click.option("--tokenizer", type=click.Path(), help="tokenizer.model to use instead of the checkpoint's.")
@click.option("--served-model-name", help="The model's name in the API [default: the directory's name].")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait behind the running one; past it, 429.")
@click.option("--api-key", envvar="CULLAMA_API_KEY", help="Require `Authorization: Bearer KEY` on /v1/* "
              "[env: CULLAMA_API_KEY].")
@friendly_errors
def serve(model_dir, host, port, device, max_seq_len, tokenizer, served_model_name, max_queue, api_key):
    """An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

    One generation at a time, the others wait in a FIFO queue. Needs the serve extra:
    pip install 'cullama[serve]'."""
    try:
        from ..server.launch import serve as run_server
    except ImportError as exc:
        click.echo(f"error: cullama serve needs the serve extra (pip install 'cullama[serve]'): {exc}", err=True)
        sys.exit(2)
    sys.exit(run_server(model_dir, host=host, port=port, device=device, max_seq_len=max_seq_len,
                        served_model_name=served_model_name, max_queue=max_queue, api_key=api_key,
                        tokenizer=tokenizer))


@main.command()
def info():
    """Python, NumPy, CuPy, NVRTC and the GPU (or why there is none)."""
    from ..device import environment

    env = environment()
    for key, value in env.items():
        if key == "gpu" and value is None:
            value = f"none ({env.get('gpu_status', 'no GPU')})"
        if key != "gpu_status":
            click.echo(f"{key:>18}: {value}")


@main.command()
@click.option("--arch", default="sm_90", show_default=True, help="GPU architecture to compile for (no GPU needed).")
@friendly_errors
def kernels(arch):
    """Compile every kernel with NVRTC; print registers, shared memory and spills (exit 1 on a spill)."""
    from ..kernel_report import compile_all

    reports = compile_all(arch)
    click.echo(f"{'kernel':<22} {'file':<14} {'defines':<22} {'regs':>5} {'smem B':>7} {'stack B':>8} {'spill st/ld':>12}")
    for r in reports:
        res = r.resources
        click.echo(f"{r.name:<22} {r.source:<14} {r.define_text:<22} {res.registers:>5} {res.smem_bytes:>7} "
                   f"{res.stack_bytes:>8} {res.spill_stores:>5}/{res.spill_loads:<6}")
    spilled = [r for r in reports if r.resources.spills]
    click.echo(f"{len(reports)} kernels compiled for {arch}; {len(spilled)} with spills or local memory")
    if spilled:
        sys.exit(1)
from . import bench as _bench  # noqa: E402,F401  (registers `cullama bench`)
