"""`cullama` commands. Parsing and printing only: the work is done by the library.

Any CullamaError becomes one line on stderr (`error: ...`) and the error's exit code: 2 for bad input, 1
for what the machine cannot do now (memory, a full disk, standard output that cannot be written). Options,
the prompt and the shapes are checked before any weight loads. Ctrl-C exits with 130 wherever it comes
(loading, the chat prompt, a generation, which keeps what was printed; `--json` prints the record so far
with finish_reason "interrupted").
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
from typing import Iterator

import click

from ..common.errors import INTERRUPTED, PromptError
from ..server import BODY_TIMEOUT_S, SHUTDOWN_GRACE_S
from . import bench
from .common import (MODEL_HELP, PREFILL_CHUNK, QUANTIZE, REVISION, Group, NonEmptyPath, note, option_file, out,
                     require_stdout, show_version)


MAX_INPUT_BYTES = 64 << 20  # the most one input (a prompt, a chat line, perplexity's text or ids) may hold


def too_long(what: str) -> PromptError:
    """The error for an input past MAX_INPUT_BYTES (/dev/zero, a mistaken file): refused, never read to its end."""
    return PromptError(f"{what} holds more than {MAX_INPUT_BYTES >> 20} MiB, the most cullama reads from one input "
                       "(some 16M tokens, far past any model's context)")


class TextInput:
    """Standard input as text: bytes that are not UTF-8 become U+FFFD, and a note says so once. A read stops
    past MAX_INPUT_BYTES, with an error."""

    def __init__(self):
        self.noted = False
        self.binary = getattr(sys.stdin, "buffer", None)

    def _text(self, data: bytes | str) -> str:
        if isinstance(data, str):
            return data
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            if not self.noted:
                self.noted = True
                note("standard input is not valid UTF-8: the bytes that are not became U+FFFD")
            return data.decode("utf-8", errors="replace")

    def _read(self, method: str) -> bytes | str:
        try:
            data = getattr(self.binary or sys.stdin, method)(MAX_INPUT_BYTES + 1)
        except OSError as exc:  # a directory given as input, a device that fails
            raise PromptError(f"cannot read standard input: {exc.strerror or exc}") from None
        if len(data) > MAX_INPUT_BYTES:  # characters, on a text stream: at least as many bytes
            raise too_long("standard input" if method == "read" else "a line of standard input")
        return data

    def read(self) -> str:
        return self._text(self._read("read"))

    def lines(self) -> Iterator[str]:
        while True:
            line = self._read("readline")
            if not line:
                return
            yield self._text(line)


def argument_text(value: str | None, name: str) -> str | None:
    """A command-line text as valid Unicode: bytes the locale could not decode (kept by Python as lone
    surrogates, which the tokenizer refuses) become U+FFFD, with a note."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        note(f"{name} is not valid UTF-8: the bytes that are not became U+FFFD")
        return value.encode("utf-8", errors="surrogateescape").decode("utf-8", errors="replace")


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
        self.done = 0  # a draft model's weights come next, from 0


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=show_version,
              help="Show the version and exit.")
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
        click.option("--model", "model_dir", required=True, type=NonEmptyPath(), help=MODEL_HELP),
        REVISION,
        click.option("--max-new-tokens", default=256, show_default=True, type=int),
        click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy."),
        click.option("--top-k", default=0, show_default=True, type=int, help="0 = off."),
        click.option("--top-p", default=1.0, show_default=True, type=float, help="1 = off."),
        click.option("--repetition-penalty", default=1.0, show_default=True, type=float),
        click.option("--seed", type=int, help="Seed for sampling (reproducible); random when omitted (--json "
                                              "records it)."),
        click.option("--stop", multiple=True, help="Stop when this text appears (repeatable)."),
        click.option("--ignore-eos", is_flag=True, help="Keep generating past the end-of-sequence token."),
        click.option("--json-schema", "json_schema_file", metavar="FILE",
                     help="Constrained decoding: the text is JSON valid against the JSON schema in FILE."),
        click.option("--regex", help="Constrained decoding: the text matches this regular expression."),
        click.option("--grammar", "grammar_file", metavar="FILE",
                     help="Constrained decoding: the text follows the Lark grammar in FILE (llguidance's dialect)."),
        click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"])),
        click.option("--max-seq-len", type=int, help="Context to allocate (default: the model's)."),
        click.option("--tokenizer", type=NonEmptyPath(), help="tokenizer.json or tokenizer.model (or a directory "
                     "holding one, or a hub id) to use instead of the checkpoint's."),
        QUANTIZE,
        PREFILL_CHUNK,
        click.option("--json", "as_json", is_flag=True, help="Print JSON: ids, text, finish reason, seed, timings, "
                                                            "the weights' format."),
    ]
    return apply(options, speculative_flags(command))  # the speculative flags listed last


def speculative_flags(command):
    """The speculative-decoding flags of `generate`, `chat` and `serve` (speculative_options checks them)."""
    return apply([
        click.option("--speculative", type=click.Choice(["ngram", "draft"]),
                     help="Speculative decoding: each step checks drafted tokens in one pass (ngram: prompt "
                          "lookup; draft: --draft-model). Greedy output is unchanged."),
        click.option("--draft-model", type=NonEmptyPath(), help="A smaller LLaMA with the same tokenizer to draft "
                                                              "tokens (implies --speculative draft; a directory or "
                                                              "a hub id)."),
        click.option("--draft-tokens", type=int, help="Tokens drafted per step, 1 to 15 [default: 4]."),
        click.option("--adaptive-draft", is_flag=True, help="Move --draft-tokens with the recent acceptance."),
    ], command)


def apply(options: list, command):
    """`command` with click `options`, listed in --help in the order given."""
    for option in reversed(options):
        command = option(command)
    return command


def generation_options(kwargs: dict, **more):
    """The sampling, stop and constraint options, checked before anything loads (OptionError names the flag)."""
    from ..generation.generate import GenerationOptions

    keys = ("max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "seed", "ignore_eos")
    stop = [argument_text(s, "--stop") for s in kwargs["stop"]]
    return GenerationOptions.checked(**{k: kwargs[k] for k in keys}, stop=stop, **constraint_options(kwargs), **more)


def constraint_options(kwargs: dict) -> dict:
    """`stream`'s constraint keywords from --json-schema FILE, --regex, --grammar FILE (a file that cannot be read
    is one line naming it; the schema's JSON is checked here, the rest when the tokenizer is known)."""
    out = {}
    if kwargs["json_schema_file"] is not None:
        text = option_file(kwargs["json_schema_file"], "--json-schema")
        try:
            out["json_schema"] = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise PromptError(f"--json-schema {kwargs['json_schema_file']} is not JSON: {exc}") from None
    if kwargs["regex"] is not None:
        out["regex"] = argument_text(kwargs["regex"], "--regex")
    if kwargs["grammar_file"] is not None:
        out["grammar"] = option_file(kwargs["grammar_file"], "--grammar")
    return out


def check_constraint(options, config, tok) -> None:
    """The options that need text have a tokenizer (stop strings, a constraint) and the constraint compiles for it
    (OptionError naming the flag): before the weights load."""
    from ..common.errors import OptionError
    from ..generation.generate import STOP_NEEDS_TEXT

    if options.stop and tok is None:
        raise OptionError("stop", STOP_NEEDS_TEXT)
    if options.constraint is None:
        return
    from ..text.grammar import Grammars

    if tok is None:
        raise OptionError(options.constraint.option, "needs the model's tokenizer, and this model has none")
    Grammars(tok, config.vocab_size, (*config.eos_token_ids, *tok.eos_ids)).check(options.constraint)


def speculative_options(kwargs: dict) -> dict:
    """`stream`'s speculative keywords from the flags, checked before anything loads; --draft-model implies
    --speculative draft."""
    from ..generation.speculative import SpeculativeOptions

    method, draft_model = kwargs["speculative"], kwargs["draft_model"]
    if draft_model is not None:
        if method not in (None, "draft"):
            raise PromptError(f"--draft-model drafts with a model: it cannot go with --speculative {method}")
        method = "draft"
    elif method == "draft":
        raise PromptError("--speculative draft needs --draft-model DIR")
    if method is None and (kwargs["draft_tokens"] is not None or kwargs["adaptive_draft"]):
        raise PromptError("--draft-tokens and --adaptive-draft need --speculative or --draft-model")
    spec = SpeculativeOptions.checked(method, kwargs["draft_tokens"], kwargs["adaptive_draft"])
    if spec is None:
        return {}
    return {"speculative": spec.method, "draft_tokens": spec.draft_tokens, "adaptive_draft": spec.adaptive}


def pick_device(device: str) -> str:
    """The device to load on; `auto` on a machine without a usable GPU says so, and why, before loading."""
    from ..runtime.device import resolve

    return resolve(device, on_fallback=note)


def load(model_dir, device, max_seq_len, tokenizer, check=None, draft_model=None, quantize=None, prefill_chunk=None,
         revision=None):
    """The model (and its draft model), with a progress bar while the weights load and its notes said once; a hub
    id's files are downloaded first where the cache lacks them (huggingface_hub's progress bars)."""
    from ..llama import Llama

    progress = LoadProgress("loading weights")
    try:
        llm = Llama.from_pretrained(model_dir, device=pick_device(device), max_seq_len=max_seq_len,
                                    tokenizer=tokenizer, progress=progress, check=check, draft_model=draft_model,
                                    quantize=quantize, prefill_chunk=prefill_chunk, revision=revision)
    finally:
        progress.close()
    for text in llm.notes:
        note(text)
    return llm


def record(result, llm) -> str:
    return json.dumps({**result.to_dict(), "device": llm.device, "weights": llm.layout.summary()})


def stream_out(stream, llm, as_json: bool) -> None:
    """Print the pieces as they become final, then the end of the output (a newline; the ids where there is
    no tokenizer; the JSON record). Ctrl-C keeps what was printed, ends it the same way (the record's
    finish_reason is "interrupted") and exits with 130."""
    interrupted = False
    try:
        for piece in stream:
            if not as_json:
                out(piece, nl=False)
    except KeyboardInterrupt:
        stream.close("interrupted")
        interrupted = True
    finally:
        stream.close()  # an error while printing leaves the model free (and the record says "cancelled")
    result = stream.result
    if as_json:
        out(record(result, llm))
    elif llm.tokenizer is None:
        out(" ".join(map(str, result.token_ids)))
    else:
        out("")
    if interrupted:
        click.echo("interrupted", err=True)
        sys.exit(INTERRUPTED)


@main.command()
@shared_options
@click.argument("prompt", required=False)
@click.option("--prompt-ids", help="Token ids instead of text, e.g. '1,450,7483'.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template (LLaMA-2's format "
              "when it has none).")
@click.option("--system", help="System prompt for --chat.")
def generate(model_dir, revision, prompt, prompt_ids, chat, system, device, max_seq_len, tokenizer, quantize, as_json,
             **kwargs):
    """Generate text from PROMPT (or standard input; an empty prompt starts from BOS alone, where the tokenizer adds
    one)."""
    require_stdout()
    from ..generation.generate import check_prompt_fits
    from ..llama import check_some_text, prompt_ids as checked_ids

    if prompt is not None and prompt_ids is not None:
        raise PromptError("give either PROMPT or --prompt-ids, not both")
    if system is not None and not chat:
        raise PromptError("--system needs --chat")
    if chat and prompt_ids is not None:
        raise PromptError("--chat wraps a text PROMPT in the chat template: it takes no --prompt-ids")
    options = generation_options(kwargs)
    spec = speculative_options(kwargs)
    ids = parse_ids(prompt_ids) if prompt_ids is not None else None
    if prompt is None and ids is None:
        prompt = "" if sys.stdin is None or sys.stdin.isatty() else TextInput().read().rstrip("\r\n")
    prompt, system = argument_text(prompt, "PROMPT"), argument_text(system, "--system")
    request: list[int] = []

    def check(config, tok, context):
        """The prompt, as ids, fits the model and its context: before the weights load."""
        if ids is not None:
            request[:] = checked_ids(ids, config.vocab_size, None)
        elif tok is None:
            raise PromptError(f"{model_dir} has no tokenizer (tokenizer.json or tokenizer.model): give the "
                              "prompt as --prompt-ids, or name a tokenizer with --tokenizer PATH")
        elif chat:
            request[:] = tok.chat_ids([{"role": "user", "content": prompt}], system=system)
        else:
            request[:] = checked_ids(prompt, config.vocab_size, tok)
            check_some_text(prompt, request)
        check_prompt_fits(len(request), context, options.max_new_tokens)
        check_constraint(options, config, tok)

    llm = load(model_dir, device, max_seq_len, tokenizer, check, kwargs["draft_model"], quantize,
               kwargs["prefill_chunk"], revision)
    stream_out(llm.stream(request, **dataclasses.asdict(options), **spec), llm, as_json)


@main.command()
@shared_options
@click.option("--system", help="System prompt for the whole conversation.")
def chat(model_dir, revision, system, device, max_seq_len, tokenizer, quantize, as_json, **kwargs):
    """A multi-turn chat: each line of standard input is a user turn; replies stream back.

    The whole conversation goes through the model's chat template (LLaMA-2's format when it has none) at every
    turn (only its new tokens are computed).
    When it outgrows the context, the oldest exchanges are dropped (the system prompt stays), with a note; a
    message too long for the context is refused and the chat goes on. An empty line is skipped, end of input
    ends the conversation."""
    require_stdout()
    options = generation_options(kwargs, reuse_cache=True)  # each turn's prompt starts with the last one's
    spec = speculative_options(kwargs)
    system = argument_text(system, "--system")

    def check(config, tok, context):
        if tok is None:
            raise PromptError(f"cullama chat needs a tokenizer: {model_dir} has no tokenizer.json or "
                              "tokenizer.model (name one with --tokenizer PATH)")
        n = len(tok.chat_ids([{"role": "user", "content": ""}], system=system))
        if n >= context:
            raise PromptError(f"--system takes {n} tokens in the chat template, which leaves no room in the "
                              f"context of {context} tokens (--max-seq-len)")
        check_constraint(options, config, tok)

    llm = load(model_dir, device, max_seq_len, tokenizer, check, kwargs["draft_model"], quantize,
               kwargs["prefill_chunk"], revision)
    interactive = sys.stdin is not None and sys.stdin.isatty()
    lines = TextInput().lines()
    messages: list[dict] = []
    while True:
        if interactive:
            click.echo("> ", nl=False, err=True)
        line = next(lines, None)
        if line is None:
            break
        if not line.strip():
            continue
        turn = messages + [{"role": "user", "content": line.strip()}]
        try:
            ids, dropped = llm.fit_chat(turn, system, options.max_new_tokens)
        except PromptError as exc:
            click.echo(f"error: {exc.for_cli()}; the message was not sent", err=True)
            continue
        if dropped:
            note(f"the conversation outgrew the context of {llm.runner.max_seq_len} tokens: dropped its oldest "
                 f"{dropped} exchange{'s' if dropped > 1 else ''}")
        messages = turn[2 * dropped:]
        stream = llm.stream(ids, **dataclasses.asdict(options), **spec)
        stream_out(stream, llm, as_json)
        messages.append({"role": "assistant", "content": stream.result.text})


@main.command()
@click.option("--model", "model_dir", required=True, type=NonEmptyPath(), help=MODEL_HELP)
@REVISION
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback: this machine only).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0 = any free port.")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--max-seq-len", type=int, help="Context to allocate (default: the model's).")
@click.option("--tokenizer", type=NonEmptyPath(), help="tokenizer.json or tokenizer.model (or a directory holding "
              "one, or a hub id) to use instead of the checkpoint's.")
@click.option("--served-model-name", help="The model's name in the API [default: the directory's name, or the hub "
              "id].")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0),
              help="Requests that may wait behind the running ones; past it, 429.")
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(1, 64),
              help="Requests decoded together, each getting exactly its solo tokens (1: one at a time); each "
              "holds a KV cache of the context.")
@click.option("--api-key", envvar="CULLAMA_API_KEY", help="Require `Authorization: Bearer KEY` on /v1/* "
              "[env: CULLAMA_API_KEY, which keeps the key out of `ps`].")
@click.option("--allowed-hosts", multiple=True, metavar="NAMES", help="Host names requests may give besides "
              "loopback and the listening address (comma-separated, repeatable; * = any).")
@click.option("--allowed-origins", multiple=True, metavar="ORIGINS", help="Web pages (scheme://host[:port]) that "
              "may use the server, CORS preflights answered (comma-separated, repeatable; * = any).")
@click.option("--body-timeout", default=BODY_TIMEOUT_S, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds a request body may take to arrive; past it, 408.")
@click.option("--shutdown-grace", default=SHUTDOWN_GRACE_S, show_default=True, type=click.FloatRange(0),
              help="Seconds open connections get to finish after SIGINT/SIGTERM before they are closed.")
@QUANTIZE
@PREFILL_CHUNK
@speculative_flags
@click.option("--replicas", type=click.IntRange(1), help="Serve from N copies of the server on a Ray cluster (one "
              "GPU each, or one CPU each on the CPU) behind this one address; needs the ray extra.")
@click.option("--min-replicas", type=click.IntRange(1), help="Autoscale from this many replicas (on the requests "
              "each holds: up past --max-batch) ...")
@click.option("--max-replicas", type=click.IntRange(1), help="... to this many.")
@click.option("--upscale-delay", default=30.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds of more requests than the replicas' batches before a replica is added.")
@click.option("--downscale-delay", default=600.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds of fewer requests before a replica is removed.")
@click.option("--autoscale-window", default=10.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds the requests per replica are averaged over.")
@click.option("--ray-address", metavar="ADDRESS", help="Join the Ray cluster at ADDRESS (`ray start --head` "
              "prints it) [default: start a local one].")
@click.option("--ray-app", default="cullama", show_default=True, metavar="NAME",
              help="The Ray Serve application's name (one per `cullama serve --replicas` on a cluster).")
@click.option("--replica-cpus", default=1.0, show_default=True, type=click.FloatRange(0),
              help="CPUs Ray reserves for each replica (besides its GPU with --device cuda).")
def serve(model_dir, revision, host, port, device, max_seq_len, tokenizer, served_model_name, max_queue, max_batch,
          api_key, allowed_hosts, allowed_origins, body_timeout, shutdown_grace, quantize, prefill_chunk, replicas,
          min_replicas, max_replicas, upscale_delay, downscale_delay, autoscale_window, ray_address, ray_app,
          replica_cpus, **flags):
    """An OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

    Up to --max-batch generations decode together (each request's tokens are the ones it gets alone), the others
    wait in a FIFO queue. The speculative options are every request's
    default; a request may change them with its own `speculative` ("ngram", "draft", "off") and `draft_tokens`
    fields. Needs the serve extra: pip install 'cullama[serve]'. With --replicas (or --min-replicas and
    --max-replicas), copies of it on a Ray cluster behind this one address (docs/replicas.md): pip install
    'cullama[ray]'."""
    if threading.current_thread() is threading.main_thread():  # SIGTERM while starting up: a clean exit too
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    spec = speculative_options(flags)
    options = dict(host=host, port=port, device=device, max_seq_len=max_seq_len, served_model_name=served_model_name,
                   max_queue=max_queue, api_key=api_key, tokenizer=tokenizer, speculative=spec,
                   draft_model=flags["draft_model"], body_timeout=body_timeout, shutdown_grace=shutdown_grace,
                   allowed_hosts=listed(allowed_hosts), allowed_origins=listed(allowed_origins), quantize=quantize,
                   max_batch=max_batch, prefill_chunk=prefill_chunk, revision=revision)
    autoscaling = min_replicas is not None or max_replicas is not None
    if replicas is not None and autoscaling:
        raise click.UsageError("give --replicas N, or --min-replicas and --max-replicas to autoscale, not both")
    if replicas is None and not autoscaling:
        ctx = click.get_current_context()
        given = [f"--{name.replace('_', '-')}" for name in ("upscale_delay", "downscale_delay", "autoscale_window",
                                                            "ray_address", "ray_app", "replica_cpus")
                 if ctx.get_parameter_source(name) != click.core.ParameterSource.DEFAULT]
        if given:
            raise click.UsageError(f"{given[0]} is an option of replicas: give --replicas N (or --min-replicas and "
                                   "--max-replicas)")
        try:
            from ..server.launch import serve as run_server
        except ImportError as exc:
            click.echo(f"error: cullama serve needs the serve extra (pip install 'cullama[serve]'): {exc}", err=True)
            sys.exit(2)
        sys.exit(run_server(model_dir, **options))
    try:
        from ..replicas.app import Scaling
        from ..replicas.launch import serve_replicas
    except ImportError as exc:
        extra = "ray" if (exc.name or "").split(".")[0] in ("ray", "httptools") else "serve"
        click.echo(f"error: cullama serve --replicas needs Ray Serve, the {extra} extra (pip install "
                   f"'cullama[{extra}]'): {exc}", err=True)
        sys.exit(2)
    scaling = Scaling(replicas or 1, min_replicas, max_replicas, upscale_delay, downscale_delay, autoscale_window)
    sys.exit(serve_replicas(model_dir, scaling, ray_address=ray_address, ray_app=ray_app, replica_cpus=replica_cpus,
                            **options))


def listed(values: tuple[str, ...]) -> tuple[str, ...]:
    """A repeatable option's comma-separated values, one by one."""
    return tuple(v.strip() for value in values for v in value.split(",") if v.strip())


@main.command()
@click.option("--model", "model_dir", type=NonEmptyPath(), help="Also say how this checkpoint's weights would run "
                                                                "(read from its headers, no weight loads; a "
                                                                "directory or a hub id).")
@REVISION
@QUANTIZE
def info(model_dir, revision, quantize):
    """Python, NumPy, CuPy, NVRTC and the GPU (or why there is none); with --model, the checkpoint's weights on
    the device: their format, bytes, and the floor a decode step's reads imply on an H200."""
    require_stdout()
    from ..runtime.device import environment, two_cupys_warning

    if quantize is not None and model_dir is None:
        raise PromptError("--quantize goes with --model")
    if revision is not None and model_dir is None:
        raise PromptError("--revision goes with --model")
    summary = model_summary(model_dir, quantize, revision) if model_dir is not None else None  # a bad model: first

    env = environment()
    for key, value in env.items():
        if key == "gpu" and value is None:
            value = f"none ({env.get('gpu_status', 'no GPU')})"
        if key == "nvrtc" and env.get("nvrtc_library"):  # one line: the version and which library is loaded
            value = f"{value} ({env['nvrtc_library']})"
        if key not in ("gpu_status", "nvrtc_library"):
            out(f"{key:>18}: {value}")
    for key, value in (summary or {}).items():
        out(f"{key:>18}: {value}")
    if warning := two_cupys_warning():
        click.echo(f"warning: {warning}", err=True)


def model_summary(model_dir, quantize, revision=None) -> dict:
    """What `info --model` prints of a checkpoint: its device layout, read from the config and the headers (a
    quantized checkpoint's scales and g_idx are read and checked too); no weight is loaded (a hub id's files are
    downloaded where the cache lacks them)."""
    from ..model import hub
    from ..model.checkpoint import open_checkpoint
    from ..model.layout import H200_READ_BYTES_PER_S
    from ..runtime.memory import gib
    from ..model.weights import check_quantize, checkpoint_layout

    check_quantize(quantize)
    layout = checkpoint_layout(open_checkpoint(hub.resolve(model_dir, revision)), quantize)
    s = layout.summary()
    return {"model": model_dir, "weights": s["weights"],
            "linears": ", ".join(f"{n} x {name}" for name, n in s["linears"].items()),
            "intermediate size": f"{layout.config.intermediate_size} (on the device {s['intermediate_size']})",
            "weight memory": gib(s["weight_bytes"]),
            "bytes per step": f"{s['decode_bytes'] / 1e9:.4g} GB (linears, lm_head)",
            "floor on an H200": f"{s['floor_ms_h200']:.3g} ms per token at {H200_READ_BYTES_PER_S / 1e12:.2f} TB/s",
            **{f"note {i + 1}": note for i, note in enumerate(s["notes"])}}


@main.command()
@click.option("--arch", default="sm_90", show_default=True, help="GPU architecture to compile for (no GPU needed).")
@click.option("--issue", is_flag=True,
              help="Also report the static issue budget: for every GEMV variant the decode, verify and batch plans "
                   "launch at the LLaMA-2-7B shapes (FP16, int8, int4), its sm_90 SASS lane-instructions per weight "
                   "byte (main loop, whole kernel) beside the H200's 7.53 and the H100's 9.99 and the 5.0 limit "
                   "(needs cuobjdump and nvdisasm: the `test` extra).")
def kernels(arch, issue):
    """Compile every kernel with NVRTC; print registers, shared memory and spills (exit 1 on a spill). Kernels
    that have no version for the arch (wgmma: sm_90 only) are skipped with a note. --issue adds the decode GEMVs'
    issue budget (docs/usage.md)."""
    require_stdout()
    from ..bench.kernels import compile_all, skipped

    reports = compile_all(arch)
    out(f"{'kernel':<22} {'file':<14} {'defines':<31} {'regs':>5} {'smem B':>7} {'stack B':>8} {'spill st/ld':>12}")
    for r in reports:
        res = r.resources
        out(f"{r.name:<22} {r.source:<14} {r.define_text:<31} {res.registers:>5} {res.smem_bytes:>7} "
            f"{res.stack_bytes:>8} {res.spill_stores:>5}/{res.spill_loads:<6}")
    spilled = [r for r in reports if r.resources.spills]
    for note in skipped(arch):
        out(f"skipped {note}")
    out(f"{len(reports)} kernels compiled for {arch}; {len(spilled)} with spills or local memory")
    if issue:
        from ..bench.issue import report

        for line in report():
            out(line)
    if spilled:
        sys.exit(1)


@main.command()
@click.option("--model", "model_dir", required=True, type=click.Path(), help=MODEL_HELP)
@REVISION
@click.argument("file", type=click.Path(allow_dash=True))
@click.option("--ids", "as_ids", is_flag=True, help="FILE holds token ids (separated by spaces, commas or newlines), "
                                                    "not text.")
@click.option("--stride", type=int, help="Ids between the starts of two windows [default: half the context].")
@click.option("--device", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda"]))
@click.option("--max-seq-len", type=int, help="The window: the context to allocate [default: the model's].")
@click.option("--tokenizer", type=NonEmptyPath(), help="tokenizer.json or tokenizer.model (or a directory holding "
                                                      "one, or a hub id) to use instead of the checkpoint's.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures and the options as JSON.")
@QUANTIZE
def perplexity(model_dir, file, as_ids, stride, device, max_seq_len, tokenizer, as_json, **load_options):
    """The perplexity of the text in FILE ('-': standard input) through the model's tokenizer (with BOS), or of
    the token ids in it (--ids). A text longer than the context is scored in sliding windows of the context,
    --stride ids apart, each id once with the context its window gives it (HuggingFace's perplexity guide)."""
    from ..llama import prompt_ids as checked_ids
    from ..runtime.logprobs import windows

    data = _read_input(file)
    ids: list[int] = []

    def check(config, tok, context):
        """The ids (or the text, through the tokenizer) and the stride, before the weights load."""
        if as_ids:
            ids[:] = checked_ids(_file_ids(data, file), config.vocab_size, None)
        elif tok is None:
            raise PromptError(f"{model_dir} has no tokenizer.model: give token ids with --ids, or name a tokenizer "
                              "with --tokenizer PATH")
        else:
            ids[:] = checked_ids(data, config.vocab_size, tok)
        if len(ids) < 2:
            raise PromptError(f"{file} holds {len(ids)} token{'s' if len(ids) != 1 else ''}: a perplexity needs at "
                              "least 2")
        windows(len(ids), context, context // 2 if stride is None else stride)  # an OptionError naming --stride

    llm = load(model_dir, device, max_seq_len, tokenizer, check, **load_options)
    result = llm.perplexity(ids, stride=stride)
    if as_json:
        out(json.dumps({**result.to_dict(), "model": str(model_dir), "file": file, "ids": as_ids,
                        "device": llm.device, **load_options}))
    else:
        settings = ", ".join(f"{k} {v}" for k, v in load_options.items() if v is not None)
        out(f"perplexity {result.perplexity:.4f} (nll {result.nll:.4f} nats per token, {result.tokens} tokens, "
            f"{result.windows} window{'s' if result.windows != 1 else ''} of {result.context} tokens, stride "
            f"{result.stride}, {llm.device}{', ' + settings if settings else ''})")


def _read_input(file: str) -> str:
    """FILE as text (standard input for '-'): bytes that are not UTF-8 become U+FFFD, with a note."""
    from pathlib import Path

    if file == "-":
        return TextInput().read()
    try:
        with open(Path(file), "rb") as fh:
            data = fh.read(MAX_INPUT_BYTES + 1)  # /dev/zero ends here, not in a full memory
    except OSError as exc:
        raise PromptError(f"cannot read {file}: {exc.strerror or exc}") from None
    if len(data) > MAX_INPUT_BYTES:
        raise too_long(file)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        note(f"{file} is not valid UTF-8: the bytes that are not became U+FFFD")
        return data.decode("utf-8", errors="replace")


def _file_ids(text: str, file: str) -> list[int]:
    """The integers of an ids file: separated by spaces, commas or newlines (a JSON list reads too)."""
    words = text.replace(",", " ").replace("[", " ").replace("]", " ").split()
    for i, word in enumerate(words):
        if not word.lstrip("-").isdigit():
            raise PromptError(f"{file}: {word[:20]!r} (item {i}) is not a token id")
    return [int(w) for w in words]


main.add_command(bench.bench)
