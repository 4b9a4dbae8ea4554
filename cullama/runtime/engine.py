"""PlanRunner: runs the plans on a backend and speaks the generation loop's Runner protocol.

    start(prompt, params): reset the state, prefill the prompt in chunks, sample the first token
    next(ahead):           replay the decode step (a CUDA graph on the GPU), read the sampled token;
                           with `ahead`, the following step is queued before this one's token is read
    drain():               wait for a step queued ahead (its token is kept for the next next())
    logits(ids):           prefill with every row's logits kept
    score(ids, top):       prefill with every row reduced to the log-probability of the next id (and `top` others)
    verify(drafts):        one pass over [last, *drafts] (speculative decoding): the accepted tokens
    max_draft():           how many drafts verify() takes now

Sequence slots (issue 17; cullama/generation/batch.py runs many generations at once on them): a runner made with `slots`
S > 1 holds S sequences, each its own KV cache, device state (position, token, step counter, sampling parameters,
seen flags) and host record (cached, last, log-probabilities). `slot` selects the one that start / next / verify /
score / logits act on, exactly as on a one-slot runner (slot 0 is that runner, bit for bit). Batched decoding:
set_batch(slots) when the batch's composition changes, then batch_step() per step: one decode step for each of
those sequences at once (plan.batch_plan: rows of up to VERIFY_ROWS sequences per launch), each row exactly its
sequence's one-row decode step; begin() is start() one prefill chunk at a time (Prefill.advance), and
begin_score() score(), so that a joining prompt's chunks can run between batched steps.

Log-probabilities (cullama/runtime/logprobs.py): start(..., logprobs=N) makes every token of that generation (start's,
next's, verify's) come with its TokenLogprob, handed out in order by take_logprobs(); the steps then run the
plans with the logprobs kernel (one more launch in the decode graph, and a copy of a few hundred bytes beside the
token's), and the others are left as they are. start(..., prompt_logprobs=N) also scores the prompt
(`prompt_logprobs` after it). Off (None, the default), nothing is added to any step.

Constrained decoding (runtime/token_mask.py): start(..., mask=M) makes the slot's every pick one that M allows. The
slot's state[MASKED] is set, and each of its steps runs in two parts (plan.split_at_sample): the forward, then the
sample kernel, between which the host hands M the last sampled token, has it write the next token's mask into the
slot's mask row and copies that row over, so the mask is computed while the forward runs on the device. With
`ahead`, the next step's forward is queued behind this step's sample, as a whole step is for a plain generation:
the device runs it while the host reads the token, hands it to M and computes the mask after it. A verify step
sends only the drafts M allows, and its rows' masks; a batched step splits where one of its rows is constrained.
A slot without a mask runs the plans whole, as ever, and its sample kernel reads no mask.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np

from . import logprobs as scoring, memory, plan as plans
from ..model.config import LlamaConfig
from ..common.errors import GenerationError, PromptError
from ..model.layout import Layout, as_layout
from .ops.rows import (STATE_MASKED as MASKED, STATE_POS as POS, STATE_SEED_HI as SEED_HI,  # common.cuh's fields
                       STATE_SEED_LO as SEED_LO, STATE_STEP as STEP, STATE_TOKEN as TOKEN, STATE_TOP_K as TOP_K)
from .prefill_kernels import PrefillKernels, default_for
from .sampling import NO_TOKEN, Sampler, SamplingParams
from .token_mask import TokenMask

FORWARD = "forward"  # _queued: a constrained step's forward is queued for `last` (its sample is not)


class _Sequence:
    """One slot's host record: the ids its KV cache holds, its last sampled token, its log-probability settings."""

    def __init__(self):
        self._cached: list[int] = []
        # The prefix cache: how many leading rows of `cached` hold K and V that a prefill from row 0 of any prompt
        # beginning with their ids writes, bit for bit (PlanRunner.prefix_rows). Never more than len(cached).
        self.exact = 0
        self.reused = 0  # prompt rows the last start / begin took from the cache instead of computing them
        self.last: int | None = None  # the last sampled token: the next decode step's input
        self.logprobs: int | None = None  # this generation's alternatives per token; None: no log-probabilities
        self.records: list[scoring.TokenLogprob] = []  # the log-probabilities of tokens returned, not taken yet
        self.prompt_logprobs: list[scoring.TokenLogprob] = []  # the last scored prompt's (start or score): ids[1:]
        # constrained decoding: the grammar's mask, which has accepted every sampled token but `last`; None: none
        self.mask: TokenMask | None = None

    @property
    def cached(self) -> list[int]:
        """The ids whose K and V are in the cache, at positions 0..len - 1."""
        return self._cached

    @cached.setter
    def cached(self, ids: list[int]) -> None:
        self._cached = ids
        self.exact = min(self.exact, len(ids))  # rows past `ids` are being rewritten, or hold other ids


def _delegated(field: str) -> property:
    """A PlanRunner attribute that is its current slot's (_Sequence.field)."""
    return property(lambda self: getattr(self._seq, field), lambda self, v: setattr(self._seq, field, v))


class Prefill:
    """A prompt on its way into the cache (PlanRunner.begin, begin_score): advance() runs one chunk and returns None,
    or on the last chunk the result (begin's first sampled token, begin_score's records). The runner's slot must be
    this prompt's at each call."""

    def __init__(self, runner: "PlanRunner", slot: int, chunks):
        self.runner, self.slot, self._chunks = runner, slot, chunks

    def advance(self) -> int | None:
        if self.runner.slot != self.slot:
            raise RuntimeError(f"the prefill of slot {self.slot} advanced with slot {self.runner.slot} selected")
        try:
            next(self._chunks)
            return None
        except StopIteration as done:
            return done.value


class PlanRunner:
    """Runs one sequence at a time (per slot: see the module docstring). `cached` only ever names the ids whose K
    and V rows were completely written (queued in full, on the GPU): it is cut back before a prefill or a step
    writes and extended after, so work cut short (a KeyboardInterrupt, an error) never leaves it claiming rows it
    overwrote. A start() or decode step cut short also drops `last`: decoding then needs a start()."""

    constrains = True  # start() takes a grammar's mask (constrained decoding)

    def __init__(self, model: LlamaConfig | Layout, backend, max_seq_len: int, prefill_chunk: int | None = None,
                 weight_bytes: int = 0, sample_vocab: int | None = None, slots: int = 1):
        """`model`: the device layout of the weights (layout.Layout; a config stands for its FP16 layout).
        `prefill_chunk`: prompt rows per prefill pass (default plan.prefill_chunk_for(model, slots): 256 rows for
        one slot, fewer for more); it sizes the prefill buffers, any prompt length works, and a prompt's K and V
        (so its answer) may depend on it. `weight_bytes`: what the weights will still take on this device
        once the runner is made: the KV cache, the runtime buffers and they must fit in what it has free, or
        a ResourceError says so before anything is allocated (make the runner before loading the weights).
        `sample_vocab`: only the ids below it are ever sampled (default: the whole vocabulary; a tokenizer
        with fewer pieces than a padded vocabulary has no text for the others). `slots`: sequences held at once
        (each its own KV cache of max_seq_len; the memory check counts them all)."""
        self.layout = as_layout(model)
        cfg = self.layout.device
        plans.check_supported(cfg)
        self.cfg, self.backend, self.max_seq_len = cfg, backend, max_seq_len
        self.sample_vocab = min(sample_vocab or cfg.vocab_size, cfg.vocab_size)
        if not 1 <= slots <= plans.MAX_SLOTS:
            raise ValueError(f"slots must be 1 to {plans.MAX_SLOTS}, got {slots}")
        self.slots = slots
        self.prefill_chunk = prefill_chunk or plans.prefill_chunk_for(self.layout, slots)
        buffers = plans.runtime_buffers(self.layout, max_seq_len, self.prefill_chunk, slots)
        kv = sum(b.nbytes for b in buffers if b.kind == "cache")
        others = sum(b.nbytes for b in buffers) - kv
        memory.check_fits(backend.device, {"KV cache": kv, "other runtime buffers": others, "weights": weight_bytes},
                          f"use a shorter context than {max_seq_len} tokens (max_seq_len, --max-seq-len; "
                          f"the KV cache takes {memory.gib(kv // max_seq_len * 1024)} per 1024 tokens"
                          + (self._fewer(backend.device, kv // slots, others + weight_bytes) if slots > 1 else ")"))
        backend.allocate(buffers)
        backend.set("rope", plans.rope_table(cfg, max_seq_len))
        backend.set("slot_rows", plans.slot_rows_table(slots))
        self._seqs = [_Sequence() for _ in range(slots)]
        self._slot_now = 0  # the slot start / next / verify act on
        self._x_of: int | None = None  # the slot whose next input the decode step's x holds (None: nobody's)
        self._decodes: dict[int, plans.Plan] = {}
        self.decode = self._decode_of(0)
        self._embed_x = plans.embed_x_plan(self.cfg)
        self._batch: list[int] = []  # set_batch's slots, in row order
        self._batch_plans: dict[tuple, plans.Plan] = {}
        self._batch_scores: np.ndarray | None = None
        self._prefills: dict[tuple, plans.Plan] = {}
        self.prefill_kernels = default_for(getattr(backend, "arch", None))  # the prompt path's GEMM and attention
        self.prefix_cache = True  # start / begin skip the rows a fresh prefill would write alike (prefix_rows)
        # the token slot of a decode step already queued for `last` (FORWARD: a constrained step's forward, alone)
        self._queued: int | str | None = None
        self._slot = 0  # the token slot the next queued step uses (two alternate)
        self._verify_plans: dict[tuple, plans.Plan] = {}  # (k, slot) -> the verify step of k drafts
        self._splits: dict[str, tuple] = {}  # plan name -> its two parts (split_at_sample) and the plan itself
        # the plans with the logprobs kernel: the steps' (at most 21 alternatives' x 9 row counts), the prefills'
        self._scored_steps: dict[tuple, plans.Plan] = {}
        self._scored_prefills: dict[tuple, plans.Plan] = {}  # bounded as _prefills is

    @staticmethod
    def _fewer(device: str, per_sequence: int, rest: int) -> str:
        """The memory check's advice on sequence slots: how many fit beside the rest at this context."""
        free, _ = memory.free_bytes(device)
        fit = "" if free is None else f"; {max(0, (free - rest) // per_sequence)} fit beside the weights"
        return f" for each of the --max-batch sequences, {memory.gib(per_sequence)} each{fit}: or fewer of them)"

    cached = _delegated("cached")
    last = _delegated("last")
    mask = _delegated("mask")
    _logprobs = _delegated("logprobs")
    _records = _delegated("records")
    prompt_logprobs = _delegated("prompt_logprobs")
    reused = _delegated("reused")

    @property
    def _seq(self) -> _Sequence:
        return self._seqs[self._slot_now]

    @property
    def slot(self) -> int:
        """The sequence slot that start / next / verify / score / logits act on (0 unless set)."""
        return self._slot_now

    @slot.setter
    def slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not one of this runner's {self.slots}")
        if slot != self._slot_now and self._queued is not None:  # a stream ended with a step queued ahead
            if self._queued != FORWARD:
                with contextlib.suppress(GenerationError):  # its token is dropped (and a NO_TOKEN with it)
                    self.backend.token(self._queued)  # ordered before anything the other slot runs
            self.last, self._queued = None, None  # this slot's device state is a step ahead: it needs a start()
        self._slot_now = slot

    def _decode_of(self, slot: int) -> plans.Plan:
        """The decode step of the sequence in `slot` (slot 0's is `decode`)."""
        if slot == 0 and hasattr(self, "decode"):
            return self.decode
        if slot not in self._decodes:
            self._decodes[slot] = plans.decode_plan(self.layout, self.max_seq_len, self.sample_vocab, slot)
        return self._decodes[slot]

    @property
    def device(self) -> str:
        return self.backend.device

    def set_prefill_kernels(self, kernels: PrefillKernels) -> None:
        """Use these prefill kernels from the next prompt on; a KernelError where this GPU cannot run them."""
        kernels.check_arch(getattr(self.backend, "arch", None))
        if kernels != self.prefill_kernels:  # other kernels sum in another order: no row is a fresh prefill's now
            for seq in self._seqs:
                seq.exact = 0
        self.prefill_kernels = kernels

    def _prefill_plan(self, start: int, n: int, output: str) -> plans.Plan:
        key = (start, n, output, self.prefill_kernels) + ((self.slot,) if self.slot else ())
        if key not in self._prefills:
            if len(self._prefills) > 64:
                self._prefills.clear()
            self._prefills[key] = plans.prefill_plan(self.layout, self.max_seq_len, start, n, output,
                                                     self.prefill_kernels, self.prefill_chunk, self.sample_vocab,
                                                     self.slot)
        return self._prefills[key]

    def _prefill(self, ids: Sequence[int], output: str, state: np.ndarray | None = None, begin: int = 0,
                 logprobs: int | None = None, prompt_logprobs: int | None = None) -> list[np.ndarray]:
        """Run ids[begin:] through in chunks (the cache already holds ids[:begin], and `cached` names no more
        than those); output applies to the last chunk ("logits": to all), and so does `logprobs` (the sampled
        token's). `prompt_logprobs`: every chunk scores its rows against the next ids, into prompt_logprobs.
        `cached` grows chunk by chunk."""
        logits = []
        for rows, _ in self._prefill_chunks(ids, output, state, begin, logprobs, prompt_logprobs):
            if rows is not None:
                logits.append(rows)
        return logits

    def _prefill_chunks(self, ids: Sequence[int], output: str, state: np.ndarray | None = None, begin: int = 0,
                        logprobs: int | None = None, prompt_logprobs: int | None = None):
        """_prefill one chunk at a time: yields after each (its logits rows for "logits", else None; whether it was
        the last)."""
        for start in range(begin, len(ids), self.prefill_chunk):
            chunk = np.asarray(ids[start:start + self.prefill_chunk], dtype=np.int32)
            n, last = len(chunk), start + len(chunk) == len(ids)
            self.backend.set("prefill_ids", chunk)
            out = output if output == "logits" or last else "none"
            if out == "sample":
                state[POS] = start + n - 1  # the sample kernel advances it to start + n
                self.backend.set("state", state[None], self.slot)
                self._x_of = self.slot  # the sample kernel writes this sequence's next input
            if prompt_logprobs is not None:
                targets = np.full(n, scoring.NO_TARGET, np.int32)  # [n] row r predicts ids[start + r + 1]
                following = ids[start + 1:start + n + 1]  # n ids, or n - 1 in the last chunk
                targets[:len(following)] = following
                self.backend.set("prefill_targets", targets)
            sampled = logprobs if out == "sample" else None  # the first token's log-probabilities
            if sampled is None and prompt_logprobs is None:
                plan = self._prefill_plan(start, n, out)
            else:
                plan = self._scored_prefill_plan(start, n, out, sampled, prompt_logprobs)
            if out == "sample" and self.mask is not None:  # the first token's mask, while the prompt runs
                forward, sample = self._split(plan)
                self.backend.run(forward)
                self._put_mask(self.slot)
                self.backend.run(sample)
            else:
                self.backend.run(plan)
            self.cached = list(ids[:start + n])  # this chunk's rows are written (queued in full, on the GPU)
            if n == self.prefill_chunk and start % n == 0 and self._seq.exact == start:
                self._seq.exact = start + n  # a whole chunk where a prefill from row 0 puts one (prefix_rows)
            if prompt_logprobs is not None:
                self.prompt_logprobs += scoring.from_rows(self.backend.read("logprob_rows")[:len(following)],
                                                          prompt_logprobs)
            yield (self.backend.read("logits_rows")[:n] if out == "logits" else None), last

    def _scored_prefill_plan(self, start: int, n: int, output: str, logprobs: int | None,
                             prompt_logprobs: int | None) -> plans.Plan:
        """The prefill chunk of _prefill_plan with the logprobs kernel: the sampled token's (output "sample",
        `logprobs`) and every row's (`prompt_logprobs`)."""
        key = (start, n, output, self.prefill_kernels, logprobs, prompt_logprobs) + ((self.slot,) if self.slot else ())
        if key not in self._scored_prefills:
            if len(self._scored_prefills) > 64:
                self._scored_prefills.clear()
            V = self.sample_vocab
            base = self._prefill_plan(start, n, output)
            if prompt_logprobs is None:  # output "sample": the first token's
                plan = plans.with_logprobs(base, logprobs, [plans.token_logprobs(V, 1, logprobs, self.slot)])
            else:
                plan = plans.scored_prefill_plan(self._prefill_plan(start, n, "none"),
                                                 self._prefill_plan(start, n, "logits"),
                                                 base if output == "sample" else None, V, self.cfg.vocab_size, n,
                                                 prompt_logprobs, logprobs, self.slot)
            self._scored_prefills[key] = plan
        return self._scored_prefills[key]

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, reuse: bool = False,
              logprobs: int | None = None, prompt_logprobs: int | None = None, mask: TokenMask | None = None) -> int:
        """Prefill the prompt and sample its first token. With `reuse`, the longest prefix of the prompt
        that the KV cache already holds (from the last generation) is not computed again: a chat turn
        prefills only what is new. The reused K and V may differ from a fresh prefill's in the last FP16
        bit, so a seeded run is reproducible only with reuse off (the default). With reuse off and `prefix_cache`
        on (the default), only the rows a fresh prefill would write bit for bit are skipped (prefix_rows): the
        answer is the fresh one. `reused` says how many rows were skipped.
        logprobs: every token of this generation comes with its log-probabilities and that many alternatives
        (take_logprobs); prompt_logprobs: the prompt is scored too, into `prompt_logprobs` (its ids[1:]; the
        whole prompt is then prefilled, whatever `reuse` says). None: off (0..20 alternatives: on).
        mask: constrained decoding, every token of this generation one that `mask` allows (the module docstring);
        it must be fresh (nothing accepted): the first token is drawn from its fill()."""
        prefill = self.begin(prompt_ids, params, reuse, logprobs, prompt_logprobs, mask)
        first = prefill.advance()
        while first is None:
            first = prefill.advance()
        return first

    def begin(self, prompt_ids: Sequence[int], params: SamplingParams, reuse: bool = False,
              logprobs: int | None = None, prompt_logprobs: int | None = None,
              mask: TokenMask | None = None) -> Prefill:
        """start() one prefill chunk at a time: the Prefill whose advance() runs the next chunk (the prompt is
        checked and the slot's sampling state set here; nothing runs on the device before the first advance)."""
        if not 0 < len(prompt_ids) < self.max_seq_len:
            raise PromptError(f"a prompt of {len(prompt_ids)} tokens needs 1 to {self.max_seq_len - 1} tokens "
                              f"(the context is {self.max_seq_len})")
        sampler = Sampler(params, self.cfg.vocab_size, prompt_ids)  # resolves the seed, marks the prompt seen
        p = sampler.params
        seed = p.seed & (2**64 - 1)
        state = np.zeros(8, dtype=np.int32)
        state[TOP_K] = min(p.top_k, self.sample_vocab)  # int32; at or above the vocabulary is off, as 0 is
        state[MASKED] = mask is not None
        state[SEED_LO:SEED_HI + 1] = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint32).view(np.int32)
        prompt = list(prompt_ids)
        if prompt_logprobs is not None:  # every row is scored
            begin = 0
        elif reuse:
            begin = min(common_prefix(self.cached, prompt), len(prompt) - 1)  # the last id runs
        else:
            begin = self.prefix_rows(prompt, self.slot)
        self.reused = begin
        # From here the cache is rewritten from row `begin`: until the prefill is through, nothing to decode
        # from, and only the rows before `begin` (and then each finished chunk's) are known to hold these ids.
        self.last, self._queued = None, None  # a step still queued is ordered before this prefill; dropped
        self.cached = prompt[:begin]
        self._logprobs, self._records, self.prompt_logprobs = logprobs, [], []
        self.mask = mask
        self.backend.set("fparams", np.array([[p.temperature, p.top_p, p.repetition_penalty, 0]], np.float32),
                         self.slot)
        self.backend.set("seen", seen_row(sampler.seen, plans.seen_stride(self.cfg.vocab_size))[None], self.slot)
        return Prefill(self, self.slot, self._first_token(prompt, state, begin, logprobs, prompt_logprobs))

    def prefix_rows(self, prompt: Sequence[int], slot: int) -> int:
        """The prefix cache: the rows of `prompt` that `slot`'s cache holds as a fresh prefill would write them, bit
        for bit, so that its prefill may start after them (0 with prefix_cache off; a batch also puts a request in
        the slot where it gets the most: generation/batch.py). A prefill runs in chunks of prefill_chunk rows from
        row 0, each chunk a function of its ids, its position, its row count (a GPU GEMM splits K by the rows:
        prefill_kernels.split_rule) and the rows before it; so the whole chunks that a prefill from row 0 (or from
        the end of such a chunk) wrote, `exact` rows, are any prompt's that begins with their ids. The prompt then
        runs from a chunk boundary in the same chunks as from row 0, and its last chunk, which samples the first
        token, always runs: the answer is the fresh one, bit for bit, whatever ran before. Rows written otherwise
        (decode and verify steps, reuse_cache's prefills from any row) never count."""
        if not self.prefix_cache:
            return 0
        seq, chunk = self._seqs[slot], self.prefill_chunk
        shared = common_prefix(seq.cached[:seq.exact], prompt)
        return min(shared, len(prompt) - 1) // chunk * chunk

    def _first_token(self, prompt, state, begin, logprobs, prompt_logprobs):
        """The generator behind a Prefill: each chunk, then the first token (its return value), read in the same
        advance() as the last chunk: another sequence's step in between would overwrite logprob_step."""
        for _, last in self._prefill_chunks(prompt, "sample", state, begin, logprobs, prompt_logprobs):
            if last:
                break
            yield
        self.last = self.backend.read_token(self.slot)
        if logprobs is not None:
            self._records += scoring.from_rows(self.backend.read("logprob_step")[:1], logprobs)
        return self.last

    def _queue_step(self) -> int:
        """Queue a whole decode step of `last` (forward and sample) and the copy of its token: its token slot."""
        slot, self._slot = self._slot, self._slot ^ 1
        self._embed_last()
        # writes the K and V of `last` at position len(cached)
        if self._logprobs is None:
            self.backend.launch_step(self._decode_of(self.slot), slot, seq=self.slot)
        else:  # the token's log-probabilities are copied out beside it: the next step overwrites logprob_step
            self.backend.launch_step(self.decode_plan(self._logprobs), slot, "logprob_step", seq=self.slot)
        return slot

    def _embed_last(self) -> None:
        if self._x_of != self.slot:  # another sequence's step or prefill wrote x since: this one's input again
            self.backend.set("verify_ids", np.array([self.last], np.int32))
            self.backend.run(self._embed_x)
            self._x_of = self.slot

    # -- constrained decoding: the steps in two parts, the mask between them --------------------------------------
    def _split(self, plan: plans.Plan) -> tuple[plans.Plan, plans.Plan]:
        """The plan's launches before its sample kernel and from it on, made once per plan (so the CUDA backend
        captures each part's graph once)."""
        parts = self._splits.get(plan.name)
        if parts is None or parts[2] is not plan:
            parts = self._splits[plan.name] = (*plans.split_at_sample(plan), plan)
        return parts[0], parts[1]

    def _queue_forward(self) -> str:
        """Queue a constrained decode step's forward of `last` (it needs no mask): FORWARD."""
        self._embed_last()
        self.backend.replay(self._split(self.decode_plan(self._logprobs))[0])  # writes the K and V of `last`
        return FORWARD

    def _put_mask(self, slot: int, accept: int | None = None) -> None:
        """Slot `slot`'s mask hands over `accept` (the token its next step samples after), writes the next token's
        mask into the slot's mask row 0, and the row is queued onto the device."""
        mask = self._seqs[slot].mask
        if accept is not None:
            mask.accept(accept)
        mask.fill(self.backend.mask_rows(slot, 1)[0])
        self.backend.upload_masks(slot, 1)

    def _next_masked(self, ahead: bool) -> None:
        """next() of a constrained slot: its forward (queued ahead, or now), its mask while the forward runs, its
        sample; with `ahead`, the next forward behind it. Sets `last`."""
        if self._queued is None:
            self._queue_forward()
        self._queued = None
        self.cached.append(self.last)  # its forward is queued in full: its K and V row will be written
        self._put_mask(self.slot, self.last)
        slot, self._slot = self._slot, self._slot ^ 1
        sample = self._split(self.decode_plan(self._logprobs))[1]
        self.backend.launch_step(sample, slot, None if self._logprobs is None else "logprob_step", seq=self.slot)
        if ahead and self.backend.asynchronous and len(self.cached) < self.max_seq_len:
            self._queued = self._queue_forward()  # its input is the token being sampled: on the device already
        self.last = self.backend.token(slot)
        if self._logprobs is not None:
            self._records += scoring.from_rows(self.backend.fetched(slot)[:1], self._logprobs)

    def decode_plan(self, logprobs: int | None = None) -> plans.Plan:
        """The decode step (`decode`), or with the logprobs kernel for `logprobs` alternatives: made once each, so
        the CUDA backend captures each as its own graph (for benchmarks: backend.replay(plan) times one)."""
        if logprobs is None:
            return self._decode_of(self.slot)
        key = (1, logprobs, self.slot)
        if key not in self._scored_steps:
            self._scored_steps[key] = plans.with_logprobs(
                self._decode_of(self.slot), logprobs,
                [plans.token_logprobs(self.sample_vocab, 1, logprobs, self.slot)])
        return self._scored_steps[key]

    def take_logprobs(self) -> list[scoring.TokenLogprob]:
        """The log-probabilities of the tokens start(), next() and verify() returned since the last call, in
        order (one per token; none unless start() asked for them)."""
        records, self._records = self._records, []
        return records

    def next(self, ahead: bool = False) -> int:
        """The next token. With `ahead` on an asynchronous backend, the step after it is queued first (it
        needs no host input: the sample kernel wrote its token, embedding and position on the device),
        so the GPU runs it while the host handles this token; the next call then only waits for it.
        Until then the backend's buffers (logits, state) are that queued step's."""
        if self.last is None:
            raise PromptError("decoding needs a prompt first: call start()")
        if self._queued is None and len(self.cached) >= self.max_seq_len:  # the step would write past the cache
            raise PromptError(f"the context of {self.max_seq_len} tokens is full")
        try:
            if self.mask is not None:
                self._next_masked(ahead)
                return self.last
            if self._queued is None:
                self._queued = self._queue_step()
            slot, self._queued = self._queued, None
            self.cached.append(self.last)  # its step is queued in full: its K and V row will be written
            if ahead and self.backend.asynchronous and len(self.cached) < self.max_seq_len:
                self._queued = self._queue_step()  # for the token `slot` will hold
            self.last = self.backend.token(slot)
            if self._logprobs is not None:
                self._records += scoring.from_rows(self.backend.fetched(slot)[:1], self._logprobs)
        except BaseException:
            # Cut short (a step half run on the CPU leaves the device state half advanced): start() again.
            self.last, self._queued = None, None
            raise
        return self.last

    def drain(self) -> None:
        """Wait for a step queued ahead; the next next() returns its token without a launch (a constrained step's
        forward: the next next() runs its sample)."""
        if self._queued == FORWARD:
            self.backend.synchronize()
        elif self._queued is not None:
            self.backend.token(self._queued)

    # -- speculative decoding ----------------------------------------------------------------------
    def max_draft(self) -> int:
        """The most drafts verify() takes now: plan.MAX_DRAFT, fewer near the end of the context (its k + 1
        rows must fit in the KV cache); 0 also when the context is full (then verify, as next, raises)."""
        return max(0, min(plans.MAX_DRAFT, self.max_seq_len - len(self.cached) - 1))

    def verify_plan(self, k: int) -> plans.Plan:
        """The verify step of k drafts (1..plan.MAX_DRAFT), made once: the CUDA backend captures it as its own
        graph (by its name, verify[k]). For benchmarks: backend.replay(plan) times one verify step; each
        replay advances the position by the tokens it accepts (1..k + 1), like a decode step's by one."""
        if (k, self.slot) not in self._verify_plans:
            self._verify_plans[k, self.slot] = plans.verify_plan(self.layout, self.max_seq_len, k, self.sample_vocab,
                                                                 self.slot)
        return self._verify_plans[k, self.slot]

    def _scored_verify_plan(self, k: int, logprobs: int) -> plans.Plan:
        """verify_plan(k) with the logprobs kernel over its rows (row r: its pick, accepted token r)."""
        key = (k + 1, logprobs, self.slot)  # keyed by rows: a decode step's is 1
        if key not in self._scored_steps:
            self._scored_steps[key] = plans.with_logprobs(
                self.verify_plan(k), logprobs, [plans.token_logprobs(self.sample_vocab, k + 1, logprobs)])
        return self._scored_steps[key]

    def verify(self, drafts: Sequence[int]) -> list[int]:
        """Check k = len(drafts) drafted tokens in ONE pass over the rows [last, *drafts] at positions
        len(cached)..len(cached) + k (k = 0 is next()). Returns the accepted tokens: the longest prefix of the
        drafts the target accepts, then the target's own next token (1..k + 1 ids). `cached` grows by last and
        all of them but the final one, which becomes `last`; the device state (position, token, step counter,
        seen, the next input) is as if plain steps had produced them.

        Greedy: row r's pick is the argmax of its logits (bit for bit a plain step's at that position), so the
        tokens are exactly what next() calls would return. Sampled: row r draws with counter step + r, the
        draft first in its inverse CDF (speculative sampling, cullama.runtime.sampling.sample's `draft`): the tokens
        are distributed as plain sampling's. Either way the drafts before a row count as seen.

        A step queued ahead (next(ahead=True)) already computed the token after `last`: it is taken as the
        first result (as next() would) and checked against the first draft; only if they agree do the other
        drafts go through a verify step after it."""
        if self.last is None:
            raise PromptError("decoding needs a prompt first: call start()")
        drafts = [int(t) for t in drafts]
        bad = [t for t in drafts if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise PromptError(f"draft token id {bad[0]} is outside the vocabulary [0, {self.cfg.vocab_size})")
        # A draft the target never samples is never accepted, nor is anything after it: the same tokens come
        # back without it (a draft with no probability changes no draw), and the kernel sees only ids it draws.
        unsampled = [i for i, t in enumerate(drafts) if t >= self.sample_vocab]
        drafts = drafts[:unsampled[0]] if unsampled else drafts
        if self.mask is not None and drafts:  # a draft the grammar refuses is never accepted, nor any after it
            drafts = drafts[:max(0, self.mask.valid_prefix([self.last, *drafts]) - 1)]
        if len(drafts) > self.max_draft():
            raise PromptError(f"{len(drafts)} drafts at position {len(self.cached)} do not fit: at most "
                              f"{self.max_draft()} now (at most {plans.MAX_DRAFT}; the context is "
                              f"{self.max_seq_len})")
        if self._queued is not None:  # that step's token is the target's pick for the first row
            first = self.next()
            if not drafts or drafts[0] != first:
                return [first]
            return [first] + self.verify(drafts[1:])
        if not drafts:
            return [self.next()]
        try:
            rows = [self.last, *drafts]
            plan = self.verify_plan(len(drafts)) if self._logprobs is None else \
                self._scored_verify_plan(len(drafts), self._logprobs)  # row r's pick is accepted[r]
            fetch = None if self._logprobs is None else "logprob_step"
            if self.mask is None:
                accepted = self.backend.verify(plan, rows, fetch)
            else:  # the rows' masks while the forward runs: row r's allows what may follow drafts[:r]
                forward, sample = self._split(plan)
                accepted = self.backend.verify(forward, rows, fetch, sample, lambda: self._put_draft_masks(drafts))
                for token in accepted[:-1]:  # the accepted drafts (`last` before the masks); the new `last` waits
                    self.mask.accept(token)
            if fetch is not None:
                self._records += scoring.from_rows(self.backend.fetched("verify")[:len(accepted)], self._logprobs)
        except BaseException:  # as in next(): a step cut short leaves the device state half advanced
            self.last, self._queued = None, None
            raise
        self.cached += [self.last, *accepted[:-1]]
        self.last = accepted[-1]
        self._x_of = self.slot  # the sample kernel wrote its next input
        return accepted

    def _put_draft_masks(self, drafts: list[int]) -> None:
        """A constrained verify step's masks: `last` accepted, then row r = the mask after drafts[:r]."""
        self.mask.accept(self.last)
        self.mask.fill_drafts(drafts, self.backend.mask_rows(self.slot, len(drafts) + 1))
        self.backend.upload_masks(self.slot, len(drafts) + 1)

    # -- batched decoding (cullama/generation/batch.py) -------------------------------------------------------
    def set_batch(self, slots: Sequence[int]) -> None:
        """The sequences the next batch_step()s decode, in row order: each must have a sampled token to decode
        from (a start() or a finished Prefill). Call it when the batch's composition changes, not per step: it
        writes each row's slot and last token to the device, and the batched steps carry on from there."""
        slots = [int(s) for s in slots]
        if not slots or len(set(slots)) != len(slots) or not all(0 <= s < self.slots for s in slots):
            raise ValueError(f"a batch is distinct slots of 0..{self.slots - 1}, got {slots}")
        idle = [s for s in slots if self._seqs[s].last is None]
        if idle:
            raise PromptError(f"slot {idle[0]} has nothing to decode from: start it first")
        groups = plans.batch_groups(self.slots)
        table = np.zeros((groups, plans.VERIFY_ROWS, 2), np.int32)  # [groups, rows, (slot, offset 0)]
        ids = np.zeros((groups, plans.VERIFY_ROWS), np.int32)  # [groups, rows] each row's last token
        for r, s in enumerate(slots):
            table[r // plans.VERIFY_ROWS, r % plans.VERIFY_ROWS, 0] = s
            ids[r // plans.VERIFY_ROWS, r % plans.VERIFY_ROWS] = self._seqs[s].last
        self.backend.set("batch_rows", table)
        self.backend.set("batch_ids", ids)
        self._batch = slots

    def _batch_plan(self, rows: int, group: int, logprobs: int | None) -> plans.Plan:
        key = (rows, group, logprobs)
        if key not in self._batch_plans:
            plan = plans.batch_plan(self.layout, self.max_seq_len, rows, group, self.sample_vocab)
            if logprobs is not None:
                plan = plans.with_logprobs(plan, logprobs, [plans.batch_logprobs(self.sample_vocab, rows, group,
                                                                                 logprobs)])
            self._batch_plans[key] = plan
        return self._batch_plans[key]

    def batch_step(self, logprobs: int | None = None) -> list[int]:
        """One decode step of every sequence of set_batch(), at once: each row's next token, in row order
        (NO_TOKEN where a row's logits had nothing to draw: that sequence cannot go on). Each row computes exactly
        what next() on its slot would. `logprobs`: also each row's log-probabilities with that many alternatives
        (batch_scores())."""
        full = [s for s in self._batch if len(self._seqs[s].cached) >= self.max_seq_len]
        if full:
            raise PromptError(f"the context of {self.max_seq_len} tokens of slot {full[0]} is full")
        scores = []
        for group, first in enumerate(range(0, len(self._batch), plans.VERIFY_ROWS)):
            rows = min(plans.VERIFY_ROWS, len(self._batch) - first)
            plan = self._batch_plan(rows, group, logprobs)
            masked = [s for s in self._batch[first:first + rows] if self._seqs[s].mask is not None]
            if not masked:
                self.backend.replay(plan)
            else:  # the constrained rows' masks while the group's forward runs
                forward, sample = self._split(plan)
                self.backend.replay(forward)
                for s in masked:
                    self._put_mask(s, self._seqs[s].last)
                self.backend.replay(sample)
            if logprobs is not None:  # the next group overwrites logprob_step
                scores.append(self.backend.read("logprob_step")[:rows])
        ids = self.backend.read("batch_ids").reshape(-1, plans.VERIFY_ROWS)
        tokens = [int(ids[r // plans.VERIFY_ROWS, r % plans.VERIFY_ROWS]) for r in range(len(self._batch))]
        for s, token in zip(self._batch, tokens):
            seq = self._seqs[s]
            seq.cached.append(seq.last)
            seq.last = token if token != NO_TOKEN else None  # a sequence with nothing drawn needs a start()
        self._batch_scores = np.concatenate(scores) if scores else None
        return tokens

    def batch_scores(self) -> np.ndarray | None:
        """The last batch_step's rows of the logprobs kernel (cullama.runtime.logprobs.from_rows), if it asked for
        them."""
        return self._batch_scores

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        if not 0 < len(token_ids) <= self.max_seq_len:
            raise PromptError(f"logits() takes 1 to {self.max_seq_len} tokens, got {len(token_ids)}")
        self.last, self._queued, self.cached, self.mask = None, None, [], None  # decoding needs a start()
        return np.concatenate(self._prefill(list(token_ids), "logits"))

    def score(self, token_ids: Sequence[int], top: int = 0) -> list[scoring.TokenLogprob]:
        """The log-probability of each of token_ids[1:] given the ids before it, with `top` alternatives: one
        prefill whose every row is reduced on the device (no vocabulary row reaches the host). Like logits(),
        it leaves nothing to decode from (the KV cache holds the ids, for a later start's reuse)."""
        prefill = self.begin_score(token_ids, top)
        records = prefill.advance()
        while records is None:
            records = prefill.advance()
        return records

    def begin_score(self, token_ids: Sequence[int], top: int = 0) -> Prefill:
        """score() one prefill chunk at a time: the Prefill whose last advance() returns the records."""
        if not 0 < len(token_ids) <= self.max_seq_len:
            raise PromptError(f"score() takes 1 to {self.max_seq_len} tokens, got {len(token_ids)}")
        self.last, self._queued, self.cached, self.mask = None, None, [], None  # decoding needs a start()
        self._logprobs, self._records, self.prompt_logprobs, self.reused = None, [], [], 0
        return Prefill(self, self.slot, self._scored(list(token_ids), top))

    def _scored(self, ids: list[int], top: int):
        """The generator behind begin_score's Prefill: each chunk, then the prompt's records (its return value)."""
        for _, last in self._prefill_chunks(ids, "none", prompt_logprobs=top):
            if last:
                break
            yield
        return self.prompt_logprobs


def seen_row(seen: np.ndarray, stride: int) -> np.ndarray:
    """A sequence's seen flags (bool [vocab]) as its row of the `seen` buffer: uint8 [stride], 0 past the vocabulary."""
    row = np.zeros(stride, np.uint8)
    row[:len(seen)] = seen
    return row


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
