"""Constrained decoding in the runner (engine.py): a slot with a grammar's mask draws only what the mask allows, its
steps split at the sample kernel with the mask copied in between, ahead of time where the backend is asynchronous;
verify steps send only the drafts the grammar allows; a constrained row of a batch is its solo self; a slot without
a mask runs the plans whole and reads no mask. On the numpy backend and on the CUDA backend's host code over the fake
GPU (tests/fake_cupy.py), whose tokens must be the numpy backend's bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from cullama import Llama
from cullama.runtime import plan as plans
from cullama.runtime.ops.sampling import mask_bits
from cullama.runtime.sampling import SamplingParams
from cullama.text.grammar import Constraint

from tests import fake_cupy

GREEDY = SamplingParams(seed=0)
PROMPT = [1, 403, 407, 261, 378]  # stories260K: BOS "Once upon a time"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 1, "maximum": 99},
                                           "mood": {"enum": ["happy", "sad", "angry"]}},
          "required": ["name", "age", "mood"], "additionalProperties": False}


class Recorded:
    """A TokenMask that records what the runner asks of it, around a real one."""

    def __init__(self, inner):
        self.inner, self.accepted, self.fills, self.masks = inner, [], 0, []

    def accept(self, token):
        self.accepted.append(int(token))
        self.inner.accept(token)

    def fill(self, out):
        self.fills += 1
        self.inner.fill(out)
        self.masks.append(out.copy())

    def valid_prefix(self, tokens):
        return self.inner.valid_prefix(tokens)

    def fill_drafts(self, drafts, out):
        self.inner.fill_drafts(drafts, out)


@pytest.fixture(scope="module")
def cpu(stories_dir):
    return Llama.from_pretrained(stories_dir, device="cpu")


def matcher(llm, constraint=None):
    return llm.grammars.matcher(constraint or Constraint.json_schema(SCHEMA))


def constrained_run(llm, params=GREEDY, n=80, ahead=False, mask=None):
    """start() with a mask and next() until EOS (or n tokens): (tokens, the mask)."""
    mask = mask or Recorded(matcher(llm))
    runner = llm.runner
    tokens = [runner.start(PROMPT, params, mask=mask)]
    while tokens[-1] not in llm.eos_ids and len(tokens) < n:
        tokens.append(runner.next(ahead=ahead))
    runner.drain()
    return tokens, mask


def test_every_token_is_one_its_mask_allowed(cpu):
    """Each token is allowed by the mask filled before it; the mask accepted each token but the last before the
    next fill; the grammar ends the text with EOS; an unconstrained run from the same prompt is not JSON."""
    tokens, mask = constrained_run(cpu)
    assert tokens[-1] in cpu.eos_ids and mask.fills == len(tokens)
    V = cpu.config.vocab_size
    for token, row in zip(tokens, mask.masks):
        assert mask_bits(row, V)[token]
    assert mask.accepted == tokens[:-1]
    assert cpu.tokenizer.decode(tokens[:-1]).lstrip().startswith('{"name": "')
    plain = [cpu.runner.start(PROMPT, GREEDY)] + [cpu.runner.next() for _ in range(len(tokens))]
    assert plain != tokens and not cpu.tokenizer.decode(plain).startswith("{")


def test_state_masked_is_set_for_the_constrained_generation_only(cpu):
    from cullama.runtime.ops.rows import STATE_MASKED

    constrained_run(cpu, n=3)
    assert cpu.runner.backend.read("state")[0, STATE_MASKED] == 1
    cpu.runner.start(PROMPT, GREEDY)
    assert cpu.runner.backend.read("state")[0, STATE_MASKED] == 0 and cpu.runner.mask is None


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.95, seed=11),
                                    SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.2, seed=3)],
                         ids=["greedy", "top-p", "top-k-penalty"])
def test_fake_gpu_equals_numpy_bit_for_bit_ahead_or_not(cpu, stories_dir, monkeypatch, params):
    """The CUDA backend's host code (split graphs, pinned mask rows, the forward queued ahead behind the sample)
    gives the numpy backend's constrained tokens, with and without `ahead`."""
    expected, _ = constrained_run(cpu, params)
    fake = fake_cupy.install(monkeypatch)
    gpu = Llama.from_pretrained(stories_dir, device="cuda")
    for ahead in (False, True):
        tokens, _ = constrained_run(gpu, params, ahead=ahead)
        assert tokens == expected, ahead
    names = set(gpu.runner.backend.graphs)
    assert names == {"decode/forward", "decode/sample"}, names  # the whole decode graph is never captured
    assert len(fake.graphs) == 2


def test_an_unconstrained_generation_runs_the_whole_graph_and_no_mask(stories_dir, monkeypatch):
    """Without a mask: one decode graph, the plan's launches as ever, no mask row written or copied."""
    fake_cupy.install(monkeypatch)
    llm = Llama.from_pretrained(stories_dir, device="cuda")
    backend = llm.runner.backend
    calls = []
    monkeypatch.setattr(backend, "mask_rows", lambda *a: calls.append(a))
    monkeypatch.setattr(backend, "upload_masks", lambda *a: calls.append(a))
    llm.runner.start(PROMPT, GREEDY)
    for _ in range(5):
        llm.runner.next(ahead=True)
    llm.runner.drain()
    assert set(backend.graphs) == {"decode"} and calls == []
    assert [l.spec.name for l in llm.runner.decode.launches][-2:] == ["gemv_logits", "sample"]


def test_the_next_forward_is_queued_before_the_token_is_read(stories_dir, monkeypatch):
    """With `ahead`, next() queues the following step's forward behind the sample, before it waits for the token:
    the device runs it while the host takes the token to the grammar and computes the next mask."""
    fake_cupy.install(monkeypatch)
    llm = Llama.from_pretrained(stories_dir, device="cuda")
    backend, order = llm.runner.backend, []
    replay, token = backend.replay, backend.token
    monkeypatch.setattr(backend, "replay", lambda plan: (order.append(plan.name), replay(plan))[1])
    monkeypatch.setattr(backend, "token", lambda slot: (order.append("token"), token(slot))[1])
    mask = Recorded(matcher(llm))
    fill = mask.fill
    mask.fill = lambda out: (order.append("fill"), fill(out))[1]
    llm.runner.start(PROMPT, GREEDY, mask=mask)
    order.clear()
    llm.runner.next(ahead=True)
    llm.runner.next(ahead=True)
    assert order == ["decode/forward", "fill", "decode/sample", "decode/forward", "token",
                     "fill", "decode/sample", "decode/forward", "token"], order


def test_verify_checks_the_drafts_against_the_grammar(cpu):
    """Drafts: the plain constrained greedy continuation, with one the grammar refuses second: the verify step sends
    only the first (a refused draft is never accepted, nor anything after it); then drafts of the continuation, all
    accepted; the tokens are plain constrained greedy's."""
    expected, _ = constrained_run(cpu)
    runner = cpu.runner
    mask = matcher(cpu)
    first = runner.start(PROMPT, GREEDY, mask=mask)
    assert first == expected[0]
    sent = []
    verify = runner.backend.verify
    runner.backend.verify = lambda plan, ids, *a: (sent.append(list(ids)), verify(plan, ids, *a))[1]
    try:
        got = [first]
        refused = next(t for t in range(cpu.config.vocab_size) if mask.valid_prefix([first, expected[1], t]) < 3)
        got += runner.verify([expected[1], refused, expected[3]])
        while got[-1] not in cpu.eos_ids:
            k = min(4, len(expected) - len(got))
            got += runner.verify(expected[len(got):len(got) + k] if k else [])
    finally:
        runner.backend.verify = verify
    assert sent[0] == [first, expected[1]]  # the refused draft and the one after it were never sent
    assert got == expected


def test_verify_with_every_draft_refused_is_a_plain_step(cpu):
    expected, _ = constrained_run(cpu, n=6)
    mask = matcher(cpu)
    runner = cpu.runner
    runner.start(PROMPT, GREEDY, mask=mask)
    refused = next(t for t in range(cpu.config.vocab_size) if mask.valid_prefix([expected[0], t]) < 2)
    assert runner.verify([refused, refused]) == [expected[1]]


def test_a_constrained_row_of_a_batch_is_its_solo_self(stories_dir):
    """Slots 0..2 batched: a constrained greedy row, an unconstrained sampled row, a constrained sampled row; each
    row's tokens equal its solo run, and the unconstrained row's equal a batch with no constraint at all."""
    llm = Llama.from_pretrained(stories_dir, device="cpu", max_batch=3)
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=5)
    solo = {}
    for key, params, constrained in (("a", GREEDY, True), ("b", sampled, False), ("c", sampled, True)):
        llm.runner.slot = 0
        mask = matcher(llm) if constrained else None
        tokens = [llm.runner.start(PROMPT, params, mask=mask)]
        for _ in range(20):
            tokens.append(llm.runner.next())
            if tokens[-1] in llm.eos_ids:
                break
        solo[key] = tokens
    runner = llm.runner
    rows = {}
    for slot, (key, params, constrained) in enumerate((("a", GREEDY, True), ("b", sampled, False),
                                                        ("c", sampled, True))):
        runner.slot = slot
        rows[slot] = [runner.start(PROMPT, params, mask=matcher(llm) if constrained else None)]
    live = [0, 1, 2]
    runner.set_batch(live)
    for _ in range(20):
        tokens = runner.batch_step()
        for slot, token in zip(live, tokens):
            rows[slot].append(token)
        ended = [s for s in live if rows[s][-1] in llm.eos_ids]
        if ended:
            live = [s for s in live if s not in ended]
            if not live:
                break
            runner.set_batch(live)
    assert rows[0] == solo["a"] and rows[1] == solo["b"][:len(rows[1])] and rows[2] == solo["c"]
    assert len(rows[1]) > 5


def test_batch_on_the_fake_gpu_equals_numpy(stories_dir, monkeypatch):
    def run(device):
        llm = Llama.from_pretrained(stories_dir, device=device, max_batch=2)
        runner = llm.runner
        for slot in (0, 1):
            runner.slot = slot
            runner.start(PROMPT, SamplingParams(temperature=0.8, seed=slot), mask=matcher(llm) if slot else None)
        runner.set_batch([0, 1])
        return [runner.batch_step() for _ in range(12)], set(getattr(runner.backend, "graphs", {}))

    expected, _ = run("cpu")
    fake_cupy.install(monkeypatch)
    tokens, graphs = run("cuda")
    assert tokens == expected
    assert graphs == {"batch[2]#0/forward", "batch[2]#0/sample"}


def test_split_at_sample_cuts_before_the_sample_kernel(cpu):
    plan = cpu.runner.decode
    forward, sample = plans.split_at_sample(plan)
    assert forward.launches + sample.launches == plan.launches
    assert [l.spec.name for l in sample.launches] == ["sample"] and forward.name == "decode/forward"
    scored = cpu.runner.decode_plan(3)
    assert [l.spec.name for l in plans.split_at_sample(scored)[1].launches] == ["sample", "logprobs"]


@pytest.mark.gpu
@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9, top_k=40, seed=2)], ids=["greedy", "top-k"])
def test_gpu_constrained_generation_is_the_cpus(cpu, stories_dir, params):
    """On a GPU (the real kernels; CULLAMA_FAKE_GPU=1 | emu: the twins | the kernels on the CPU executor): a constrained
    generation, steps queued ahead, gives the CPU's tokens (greedy bit for bit; top-k 40 here rarely meets a bucket
    edge), every one allowed by its mask, and the text is JSON of the schema."""
    import json

    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema validates the JSON (prepare_device.sh carries it)")
    expected, _ = constrained_run(cpu, params)
    gpu = Llama.from_pretrained(stories_dir, device="cuda")
    tokens, mask = constrained_run(gpu, params, ahead=True)
    for token, row in zip(tokens, mask.masks):
        assert mask_bits(row, gpu.config.vocab_size)[token]
    assert tokens == expected or params.temperature != 0
    assert tokens[-1] in gpu.eos_ids
    jsonschema.validate(json.loads(gpu.tokenizer.decode(tokens[:-1])), SCHEMA)
