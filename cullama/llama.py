"""The public API: `Llama.from_pretrained(path)`, then `generate`, `stream`, `logits`, `logprobs` and `perplexity`.

    llm = cullama.Llama.from_pretrained("path/to/llama-2-7b-hf")
    print(llm.generate("The capital of France is", max_new_tokens=20).text)

One generation at a time per model (generate.RunnerGuard): a new generation ends an unfinished stream
(its next read raises SupersededError), and calls from several threads are serialised, never mixed.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .model import checkpoint, hub
from .runtime import device as devices, logprobs as scoring, plan as plans
from .model.config import LlamaConfig, from_pretrained as read_config, preset
from .common.errors import OptionError, PromptError
from .generation.generate import STOP_NEEDS_TEXT, Generation, GenerationOptions, GenerationStream, Runner, RunnerGuard
from .runtime.backends import make_backend
from .runtime.engine import PlanRunner
from .runtime.sampling import INT32_MAX, is_int
from .generation.speculative import SpeculativeDecoder, SpeculativeOptions, SpeculativeStream
from .generation.batch import BatchedStream, BatchSession
from .model.weights import check_quantize, checkpoint_layout, config_layout
from .runtime.load import load_checkpoint, random_weights
from .text.grammar import Grammars
from .text.tokenizer import find_tokenizer, load_tokenizer
from .text.tokenizer_base import TokenizerBase

Progress = Callable[[int, int], None]  # (bytes done, bytes total) while weights load
# The caller's own check, run before the weights load: (config, tokenizer or None, context in tokens)
Check = Callable[[LlamaConfig, "TokenizerBase | None", int], None]


class Llama:
    """A loaded model on one device, with its tokenizer when the checkpoint has one.

    One generation at a time: the model holds one KV cache. `generate` and `logits` hold the model for their
    whole run, so calls from several threads wait for each other (and each gets what it would get alone). A
    `stream` holds it while it computes each token; starting another generation before a stream is finished
    ends that stream: its next read raises SupersededError, and its `result` keeps what it streamed, with
    finish_reason "cancelled". A stream that is closed or dropped mid-way leaves the model ready."""

    def __init__(self, config: LlamaConfig, runner: Runner, tokenizer: TokenizerBase | None, device: str,
                 notes: Sequence[str] = (), draft: "Llama | None" = None):
        self.config, self.runner, self.tokenizer, self.device = config, runner, tokenizer, device
        self.notes = list(notes)  # things the user should hear once (e.g. a dtype conversion)
        self.guard = RunnerGuard()  # one generation at a time on self.runner
        # speculative="draft"'s model: its runner is driven only from this model's generations, under self.guard
        self.draft = draft
        self._grammars: Grammars | None = None
        self._grammars_made = threading.Lock()  # a server's request threads may ask for it at once

    @property
    def layout(self):
        """The device layout of the weights (cullama.model.layout.Layout): what the model runs in (layout.describe(),
        layout.summary()), its bytes."""
        return self.runner.layout

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, device: str = "auto", max_seq_len: int | None = None,
                        tokenizer: str | os.PathLike | None = None, progress: Progress | None = None,
                        check: Check | None = None, draft_model: str | os.PathLike | None = None,
                        quantize: str | None = None, max_batch: int = 1,
                        prefill_chunk: int | None = None, revision: str | None = None) -> "Llama":
        """Load an HF-format LLaMA checkpoint (safetensors) onto `device` ("auto", "cpu", "cuda"): a directory, or a
        HuggingFace hub id ("meta-llama/Llama-2-7b-hf", at `revision`: a branch, tag or commit id) read from the
        local hub cache and downloaded where it is missing, as transformers does (cullama/model/hub.py; the `hub`
        extra). `draft_model` and `tokenizer` may be hub ids too (their default branch).

        Plain checkpoints (FP16, BF16, FP32) run in FP16, or with quantize="int8" | "int4" quantized on load
        (int8 per output channel, int4 in groups of 128 along the inputs: cullama/model/layout.py); AWQ and GPTQ
        checkpoints run as they are stored (quantize must then be None). `llm.layout` says what it runs in.

        What can be checked without the weights is checked before they load, in this order: the paths' types,
        quantize, the device, the hub ids (downloaded where needed), config.json (with quantize) and the shapes
        cullama's kernels support, max_seq_len, the tokenizer (its pieces must be ids of the model's vocabulary; the
        ids of a padded vocabulary past them are never sampled), the draft model's vocabulary, `check(config,
        tokenizer, context)` (the caller's own, e.g. its prompt), the checkpoint's files and tensors (a quantized
        one's scales and g_idx read and checked), and the memory the KV cache and the weights need.

        draft_model: a smaller LLaMA checkpoint with the same tokenizer, loaded after this one on the same
        device with the same context, for speculative="draft" (as it is stored: quantize applies to this model
        only); one with another vocabulary size or other pieces is refused before any weight loads.

        max_batch: sequences decoded at once (1 to plan.MAX_SLOTS; a KV cache of the context each, counted in the
        memory check): generate(list_of_prompts) and batch() run that many together (cullama/generation/batch.py).
        prefill_chunk: prompt rows per prefill pass (1 to plan.MAX_PREFILL_CHUNK), for every generation of this
        model, solo and batched alike (a prompt's answer can depend on it); None: 256 with max_batch 1 (the fastest
        first token), else the rule of plan.batch_prefill_chunk (64 for a 7B model in FP16), which keeps the running
        requests' gap between tokens within about two decode steps while a prompt joins them."""
        notes: list[str] = []
        max_batch = checked_max_batch(max_batch)
        prefill_chunk = checked_prefill_chunk(prefill_chunk)
        for value, name in ((path, "path"), (tokenizer, "tokenizer"), (draft_model, "draft_model")):
            checked_path(value, name)  # its type, before it is read as a path or a hub id
        check_quantize(quantize)
        device = devices.resolve(device, on_fallback=notes.append)
        # hub ids to their snapshots (a download, where the cache lacks them): after the cheap checks
        path = checked_path(hub.resolve(path, revision), "path") if path is not None else None
        if tokenizer is not None:
            tokenizer = checked_path(hub.resolve(tokenizer, files=hub.TOKENIZER_FILES, what="tokenizer"), "tokenizer")
        if draft_model is not None:
            draft_model = checked_path(hub.resolve(draft_model, what="draft model"), "draft_model")
        config = read_config(path)
        plans.check_supported(config_layout(config, quantize).device)
        seq_len = checked_context(config, max_seq_len)
        tok = None
        if tokenizer is not None or find_tokenizer(path) is not None:
            tok = load_tokenizer(path, override=tokenizer)
            tok.check_fits(config.vocab_size)
        if draft_model is not None:
            check_draft(draft_model, config, tok)
        if check is not None:
            check(config, tok, seq_len)
        ckpt = checkpoint.open_checkpoint(path, config)
        layout = checkpoint_layout(ckpt, quantize)
        if ckpt.conversion_note:
            notes.append(ckpt.conversion_note)
        notes += layout.notes
        backend = make_backend(device)
        # fits, or says so; the ids past a smaller tokenizer's pieces (a padded vocabulary) are never sampled
        runner = PlanRunner(layout, backend, seq_len, weight_bytes=layout.weight_bytes(),
                            sample_vocab=tok.vocab_size if tok else None, slots=max_batch,
                            prefill_chunk=prefill_chunk)
        load_checkpoint(backend, ckpt, progress, layout)
        draft = None if draft_model is None else cls.from_pretrained(draft_model, device, seq_len, progress=progress)
        return cls(config, runner, tok, device, notes + (draft.notes if draft else []), draft)

    @classmethod
    def synthetic(cls, config: LlamaConfig | str, device: str = "auto", max_seq_len: int | None = None,
                  seed: int = 0, quantize: str | None = None, max_batch: int = 1,
                  prefill_chunk: int | None = None) -> "Llama":
        """Random weights of a preset's (or any config's) shape, made on the device: no download. quantize
        ("int8" | "int4"): random codes and (scale, zero) pairs in the layout on-load quantization gives;
        max_batch, prefill_chunk: as from_pretrained's. For benchmarks; there is no tokenizer, so prompts are
        token ids."""
        check_quantize(quantize)
        max_batch = checked_max_batch(max_batch)
        prefill_chunk = checked_prefill_chunk(prefill_chunk)
        config = preset(config) if isinstance(config, str) else config
        device = devices.resolve(device)
        layout = config_layout(config, quantize)
        plans.check_supported(layout.device)
        backend = make_backend(device)
        runner = PlanRunner(layout, backend, checked_context(config, max_seq_len),
                            weight_bytes=layout.weight_bytes(), slots=max_batch, prefill_chunk=prefill_chunk)
        random_weights(backend, layout, seed)
        return cls(config, runner, None, device)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Generation stops at any of these: the model's EOS ids (config.json's, then generation_config.json's)
        and the tokenizer's (tokenizer_config.json's eos_token: a chat template's end of turn), as vLLM stops."""
        return tuple(dict.fromkeys((*self.config.eos_token_ids, *(self.tokenizer.eos_ids if self.tokenizer else ()))))

    @property
    def grammars(self) -> Grammars:
        """The grammars compiled for this model (constrained decoding: cullama/text/grammar.py), made on first use."""
        with self._grammars_made:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise OptionError("constraint", "needs the model's tokenizer (a grammar is matched as text), and "
                                                    "this model has none")
                self._grammars = Grammars(self.tokenizer, self.config.vocab_size, self.eos_ids)
            return self._grammars

    # -- prompts ----------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int] | np.ndarray) -> list[int]:
        """Text -> ids with BOS where the tokenizer adds one (an empty text is BOS alone); ids (a list, tuple
        or 1-D integer array) are checked against the vocabulary and taken as they are."""
        return prompt_ids(prompt, self.config.vocab_size, self.tokenizer)

    def chat_ids(self, messages: list[dict], system: str | None = None, tools: list | None = None) -> list[int]:
        """Prompt ids for a chat, ready for the reply: the checkpoint's chat template, else LLaMA-2's format
        (see TokenizerBase.chat_ids: `tools` and the messages of tool calls go to a template that reads them)."""
        if self.tokenizer is None:
            raise PromptError("chat_ids() needs a tokenizer and this model has none: put its tokenizer.json or "
                              "tokenizer.model in its directory or load it with tokenizer=PATH")
        if isinstance(system, str):  # another type is refused by the tokenizer, naming `system`
            check_text(system, "the system prompt")
        for i, message in enumerate(messages if isinstance(messages, (list, tuple)) else ()):
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                check_text(message["content"], f"message {i}")
        return self.tokenizer.chat_ids(messages, system=system, tools=tools)

    def tool_format(self):
        """How this model's replies spell tool calls (cullama/text/tools.py): its chat template's format."""
        from .text.tools import tool_format

        template = getattr(self.tokenizer, "template", None)
        return tool_format(template.text if template is not None else None)

    def fit_chat(self, messages: list[dict], system: str | None, reply_tokens: int) -> tuple[list[int], int]:
        """Prompt ids for a chat whose history may have outgrown the context: the oldest exchanges (a user
        message and its reply) are dropped, the system prompt and the last message kept, until the prompt
        leaves room for min(reply_tokens, half the context) new tokens, or until only the last message is
        left. Returns (ids, exchanges dropped); PromptError when the last message alone leaves no room."""
        context = self.runner.max_seq_len
        room = max(1, min(reply_tokens, context // 2))
        messages = list(messages)
        head = messages[:1] if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system" \
            else []  # a system message stays, as `system` does
        turns = messages[len(head):]
        exchanges = max(0, (len(turns) - 1) // 2)
        for dropped in range(exchanges + 1):
            ids = self.chat_ids(head + turns[2 * dropped:], system=system)
            if len(ids) + room <= context:
                return ids, dropped
        if len(ids) >= context:
            raise PromptError(f"the last message takes {len(ids)} tokens in the chat template"
                              f"{' with the system prompt' if system else ''}, which leaves no room in the context "
                              f"of {context} tokens")
        return ids, exchanges

    # -- generation ------------------------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 256, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, repetition_penalty: float = 1.0, seed: int | None = None,
               stop: str | Sequence[str] | None = (), ignore_eos: bool = False,
               reuse_cache: bool = False, speculative=None, draft_tokens: int | None = None,
               adaptive_draft: bool = False, logprobs: int | None = None,
               prompt_logprobs: int | None = None, json_schema: dict | str | None = None, regex: str | None = None,
               grammar: str | None = None, constraint=None) -> GenerationStream:
        """Iterate over text pieces as they become final; the stream's `.result` is the Generation.

        Every option is checked here (OptionError, a PromptError, naming it), before anything runs.
        seed: None draws one at random, reported as `result.seed`. stop: a string, a list of them, or None.
        reuse_cache: skip the prompt prefix the KV cache still holds from the last generation (a chat turn
        then prefills only what is new); off by default, since reused K and V can differ from a fresh
        prefill's in the last FP16 bit.
        speculative: None (plain decoding, the default), "ngram" (prompt lookup), "draft" (the draft model
        of from_pretrained(draft_model=...)) or a drafter object (cullama.generation.drafters): each target pass checks
        draft_tokens (1..15, default 4) drafted tokens at once, and adaptive_draft moves that number with the
        recent acceptance. Greedy output is the same as plain decoding's; `result.speculative` holds the
        statistics (method, k, steps, drafted, accepted, tokens per step).
        logprobs: None (off), or N from 0 to 20: `result.logprobs` holds each generated token's log-probability
        (TokenLogprob, EOS's too) and its N most likely alternatives, under the model's raw softmax (before the
        repetition penalty, temperature, top-k and top-p; cullama/runtime/logprobs.py), computed on the device beside
        the token (speculative decoding: from the verify rows). prompt_logprobs: the same for every prompt id
        (`result.prompt_logprobs`, None for the first), from the prompt's one prefill (the whole prompt is then
        prefilled, whatever reuse_cache says); with max_new_tokens=0 the prompt is only scored.
        Constrained decoding, at most one of: json_schema (a dict, or its JSON text: the text is JSON that
        validates against it), regex (a regular expression the whole text matches), grammar (a Lark grammar,
        llguidance's dialect), constraint (a cullama.Constraint: Constraint.json_schema(schema, strict=False)
        ignores the keywords it cannot enforce, where json_schema= refuses them). Every token is drawn only from
        the ids the grammar allows next (the mask reaches the sampler on the device; docs/usage.md), and the text
        ends with EOS once the grammar is complete (max_new_tokens can cut it first: finish_reason "length").
        Needs llguidance (pip install 'cullama[constrained]'); a schema, regex or grammar it cannot enforce is an
        OptionError naming the option. Cannot go with ignore_eos.

        The stream starts computing at its first read, and from then on it owns the model until it ends:
        another generation started before that ends it (see the class docstring)."""
        args, spec, reuse_cache = self._stream_args(prompt, max_new_tokens, temperature, top_k, top_p,
                                                    repetition_penalty, seed, stop, ignore_eos, reuse_cache,
                                                    speculative, draft_tokens, adaptive_draft, logprobs,
                                                    prompt_logprobs, json_schema, regex, grammar, constraint)
        if spec is None:
            return GenerationStream(*args)
        return SpeculativeStream(*args, drafter=spec.drafter(self.draft.runner if self.draft else None, reuse_cache),
                                 length=spec.length())

    def _stream_args(self, prompt, max_new_tokens=256, temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0,
                     seed=None, stop=(), ignore_eos=False, reuse_cache=False, speculative=None, draft_tokens=None,
                     adaptive_draft=False, logprobs=None, prompt_logprobs=None, json_schema=None, regex=None,
                     grammar=None, constraint=None):
        """stream()'s options checked and its prompt encoded: (the stream's arguments, the speculative options or
        None, reuse_cache). A constraint is compiled here (once per model and grammar) and its matcher made."""
        options = GenerationOptions.checked(
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            repetition_penalty=repetition_penalty, seed=seed, stop=stop, ignore_eos=ignore_eos,
            reuse_cache=reuse_cache, logprobs=logprobs, prompt_logprobs=prompt_logprobs, json_schema=json_schema,
            regex=regex, grammar=grammar, constraint=constraint)
        spec = SpeculativeOptions.checked(speculative, draft_tokens, adaptive_draft)
        if options.stop and self.tokenizer is None:
            raise OptionError("stop", STOP_NEEDS_TEXT)
        ids = self.encode(prompt)
        check_some_text(prompt, ids)
        mask = None if options.constraint is None else self.grammars.matcher(options.constraint)
        detok = self.tokenizer.stream_decoder() if self.tokenizer else None
        return (self.runner, detok, ids, options, self.eos_ids, self.guard, mask), spec, reuse_cache

    def batch(self) -> BatchSession:
        """A session that decodes many generations at once, up to the model's max_batch (cullama/generation/batch.py):
        its submit(prompt, **options) takes stream()'s options, and each request's tokens are the ones it gets alone
        (the same seed, the same tokens), whoever it runs with. reuse_cache is ignored there (every prompt is
        prefilled in full, into its own slot)."""
        return BatchSession(self.runner, self.guard, self._batched_stream)

    def _batched_stream(self, prompt, **options) -> BatchedStream:
        args, spec, _ = self._stream_args(prompt, **options)
        decoder = None
        if spec is not None:
            decoder = SpeculativeDecoder(self.runner, spec.drafter(self.draft.runner if self.draft else None),
                                         spec.length())
        return BatchedStream(*args, decoder=decoder)

    def generate(self, prompt: str | Sequence[int] | list, **options) -> Generation | list[Generation]:
        """Generate to the end; same options as `stream`. Holds the model throughout: concurrent calls from
        other threads wait their turn.

        A list of prompts (texts, or id lists) runs them together, max_batch at a time (batch()), and returns
        their Generations in order, each equal to its own generate(prompt, **options): the same tokens, the same
        seed (a seed of None draws one per prompt). Every prompt's options are checked before any runs. A
        request that fails on the way (no token to draw) ends with finish_reason "error" and the others go on."""
        if is_prompt_list(prompt):
            session = self.batch()
            with self.guard.lock:
                streams = [session.submit(p, **options) for p in prompt]
                session.run()
            return [s.result for s in streams]
        stream = self.stream(prompt, **options)
        with self.guard.lock:
            for _ in stream:
                pass
        return stream.result

    def logits(self, prompt: str | Sequence[int]) -> np.ndarray:
        """float32 [len(ids), vocab]: the logits at every position of the prompt (token ids, or text, which
        gets BOS). Ends an unfinished stream, like any generation, and leaves nothing to decode from."""
        ids = self.encode(prompt)
        if not ids:
            raise PromptError("logits() needs at least one token id")
        if len(ids) > self.runner.max_seq_len:
            raise PromptError(f"{len(ids)} tokens do not fit in the context of {self.runner.max_seq_len}")
        with self.guard.lock:
            self.guard.claim()
            return np.asarray(self.runner.logits(ids), dtype=np.float32)

    def logprobs(self, prompt: str | Sequence[int], top: int = 0) -> list[scoring.TokenLogprob | None]:
        """The log-probability of every prompt token given the ones before it (token ids, or text, which gets
        BOS), with the `top` (0 to 20) most likely ids at each position: [None (nothing predicts the first
        token), TokenLogprob, ...], one per token. One prefill whose rows are reduced on the device, under the
        model's raw softmax (cullama/runtime/logprobs.py). At most the context's tokens (perplexity() takes any length).
        Ends an unfinished stream, like any generation, and leaves nothing to decode from."""
        if scoring.checked_top(top, "top") is None:
            raise OptionError("top", f"must be an integer from 0 to {scoring.MAX_TOP}, got None")
        ids = self.encode(prompt)
        if not ids:
            raise PromptError("logprobs() needs at least one token id")
        if len(ids) > self.runner.max_seq_len:
            raise PromptError(f"{len(ids)} tokens do not fit in the context of {self.runner.max_seq_len} "
                              "(perplexity() scores a longer text in sliding windows)")
        with self.guard.lock:
            self.guard.claim()
            return [None, *self.runner.score(ids, int(top))]

    def perplexity(self, prompt: str | Sequence[int], stride: int | None = None) -> scoring.Perplexity:
        """The perplexity of a text (with BOS) or of token ids, of any length: windows of the whole context
        (max_seq_len), `stride` ids apart (default half the context), each id scored once with the context its
        window gives it, as HuggingFace's perplexity guide does (cullama.runtime.logprobs.windows). One prefill per
        window; holds the model throughout."""
        context = self.runner.max_seq_len
        stride = context // 2 if stride is None else stride
        if not is_int(stride) or not 1 <= stride <= context:
            raise OptionError("stride", f"must be an integer from 1 to the context ({context}), got {stride!r}")
        ids = self.encode(prompt)

        def score(window: Sequence[int]) -> list[float]:
            return [record.logprob for record in self.runner.score(window)]

        with self.guard.lock:
            self.guard.claim()
            return scoring.perplexity(score, ids, context, int(stride))


def prompt_ids(prompt, vocab_size: int, tokenizer: TokenizerBase | None) -> list[int]:
    """A prompt as ids: text through the tokenizer (with BOS where it adds one), or token ids checked one by one
    (ints or NumPy integers, each in [0, vocab_size)). PromptError for anything else: bytes, floats, bools,
    nested lists."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise PromptError("this model has no tokenizer (tokenizer.json or tokenizer.model): give token ids, "
                              "or name a tokenizer (tokenizer=PATH, --tokenizer PATH)")
        check_text(prompt, "the prompt")
        return tokenizer.encode(prompt, bos=True)
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or prompt.dtype.kind not in "iu":
            raise PromptError(f"a prompt array must hold token ids: 1-D and of an integer dtype, got "
                              f"{prompt.ndim}-D {prompt.dtype}")
    elif not isinstance(prompt, (list, tuple, range)):
        raise PromptError(f"a prompt is text (str) or a list of token ids (int), not {type(prompt).__name__}")
    for i, token in enumerate(prompt):
        if not is_int(token):
            raise PromptError(f"token {i} of the prompt must be an int id, got {token!r} ({type(token).__name__})")
        if not 0 <= token < vocab_size:
            raise PromptError(f"token id {token} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in prompt]


def check_some_text(prompt, ids: Sequence[int]) -> None:
    """A text prompt that encodes to no ids ("" where the tokenizer adds no BOS, as Qwen2's) is refused saying
    so (encode itself gives [] for it, as transformers does)."""
    if isinstance(prompt, str) and not ids:
        raise PromptError("the prompt is empty, and this model's tokenizer adds no BOS to start from: give some "
                          "text or token ids")


def checked_path(value, name: str) -> Path | None:
    """A path argument (str or os.PathLike) as a Path, None as None; OptionError naming `name` for anything else."""
    if value is None:
        return None
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str):
        raise OptionError(name, f"must be a str or an os.PathLike, got {type(value).__name__}")
    if not text:  # Path("") is the current directory: whatever checkpoint is there would load
        raise OptionError(name, 'is empty: name a path ("." for the current directory)')
    return Path(text)


def check_draft(path: str | os.PathLike, config: LlamaConfig, tokenizer: TokenizerBase | None) -> None:
    """ConfigError, before any weight loads, for a draft model that does not share the target's vocabulary."""
    from .generation.drafters import check_draft_vocabulary

    draft_config = read_config(path)
    draft_tok = load_tokenizer(path) if find_tokenizer(path) is not None else None
    check_draft_vocabulary(path, draft_config.vocab_size, config.vocab_size, draft_tok, tokenizer)


def check_text(text: str, what: str) -> None:
    """PromptError for text the tokenizer cannot take: a lone surrogate (undecodable bytes that Python kept
    as such, e.g. from a command line in another encoding)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(f"{what} is not valid Unicode (character {exc.start}: {exc.reason})") from None


def checked_context(config: LlamaConfig, max_seq_len: int | None) -> int:
    """The context in tokens: `max_seq_len` (OptionError unless an integer from 2 to INT32_MAX), else the model's."""
    if max_seq_len is None:
        return config.max_seq_len
    if not is_int(max_seq_len) or not 2 <= max_seq_len <= INT32_MAX:
        raise OptionError("max_seq_len", f"must be an integer from 2 to {INT32_MAX}, got {max_seq_len!r}")
    return int(max_seq_len)


def is_prompt_list(prompt) -> bool:
    """A list (or tuple) of prompts, each a text or a sequence of ids: not one prompt of ids."""
    return isinstance(prompt, (list, tuple)) and len(prompt) > 0 and \
        all(isinstance(p, (str, list, tuple, np.ndarray)) for p in prompt)


def checked_max_batch(max_batch) -> int:
    """max_batch as an int of 1..plan.MAX_SLOTS, or an OptionError naming it."""
    if not is_int(max_batch) or not 1 <= max_batch <= plans.MAX_SLOTS:
        raise OptionError("max_batch", f"must be an integer from 1 to {plans.MAX_SLOTS}, got {max_batch!r}")
    return int(max_batch)


def checked_prefill_chunk(prefill_chunk) -> int | None:
    """prefill_chunk as an int of 1..plan.MAX_PREFILL_CHUNK, None as None (the rule's), or an OptionError naming it."""
    if prefill_chunk is None:
        return None
    if not is_int(prefill_chunk) or not 1 <= prefill_chunk <= plans.MAX_PREFILL_CHUNK:
        raise OptionError("prefill_chunk", f"must be an integer from 1 to {plans.MAX_PREFILL_CHUNK}, "
                                           f"got {prefill_chunk!r}")
    return int(prefill_chunk)
