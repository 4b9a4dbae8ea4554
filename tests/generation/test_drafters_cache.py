"""When the draft model rebuilds its KV cache and when it reuses it, counted directly: the rows each proposal
prefills on the draft's runner (recorded where the runner hands the backend its prefill ids). The drafts are
the same either way, so the output cannot show it; the cost can double.

- a generation's first proposal prefills the whole text (prompt and first token), whatever the cache held from
  the last generation, unless reuse_cache (a chat turn): then only what the cache does not hold;
- every later proposal prefills only the rows past the cached text: the last draft and the target's token
  when every draft was accepted (2 rows), the target's token alone after a rejection (1 row)."""

from __future__ import annotations

import pytest

import cullama
from cullama.generation.drafters import DraftModel
from cullama.runtime.engine import common_prefix

PROMPT = [1, 403, 407, 261, 378]  # BOS "Once upon a time"


@pytest.fixture(scope="module")
def stories(stories_dir):
    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


def prefilled_rows(runner, monkeypatch) -> list[int]:
    """A list that gets, for each prefill on `runner`, how many rows it ran (chunks of one prefill summed)."""
    rows, real_set, real_start = [], runner.backend.set, runner.start

    def set(name, array, row=0):
        if name == "prefill_ids":
            rows[-1] += len(array)
        real_set(name, array, row)

    def start(*args, **kwargs):
        rows.append(0)
        return real_start(*args, **kwargs)

    monkeypatch.setattr(runner.backend, "set", set)
    monkeypatch.setattr(runner, "start", start)
    return rows


def greedy(stories, n: int, prompt=PROMPT) -> list[int]:
    return stories.generate(prompt, max_new_tokens=n, ignore_eos=True).token_ids


def test_proposals_prefill_only_what_the_cache_lacks(stories, monkeypatch):
    text = greedy(stories, 20)
    rows = prefilled_rows(stories.runner, monkeypatch)
    drafter = DraftModel(stories.runner)
    drafter.reset(PROMPT)
    drafter.extend(text[:1])
    assert drafter.propose(4) == text[1:5] and rows == [len(PROMPT) + 1]  # fresh: the whole text
    drafter.extend(text[1:6])  # all four drafts accepted, then the target's own token
    assert drafter.propose(4) == text[6:10] and rows[-1] == 2  # the last draft and the target's token
    drafter.extend([*text[6:8], 300])  # two accepted, then a token the draft did not propose
    drafter.propose(3)
    assert rows[-1] == 1  # the target's token: the accepted drafts' rows are already cached
    drafter.extend([301])  # none accepted
    drafter.propose(2)
    assert rows[-1] == 1 and len(rows) == 4


@pytest.mark.parametrize("reuse_cache", [False, True])
def test_a_new_generation_starts_fresh_unless_it_reuses_the_cache(stories, monkeypatch, reuse_cache):
    text = greedy(stories, 10)
    drafter = DraftModel(stories.runner, reuse_cache=reuse_cache)
    drafter.reset(PROMPT)
    drafter.extend(text[:1])
    drafter.propose(4)
    rows = prefilled_rows(stories.runner, monkeypatch)
    follow_up = [*PROMPT, *text[:3], 299]  # the next turn: the first text and more
    assert text[3] != 299
    drafter.reset(follow_up)
    drafter.extend([300])
    drafter.propose(4)
    # The cache holds PROMPT + text[:4] (the first text and the drafts' rows): a fresh start ignores it.
    reused = len(PROMPT) + 3  # the common prefix with the new text
    assert rows == [len(follow_up) + 1 - reused] if reuse_cache else rows == [len(follow_up) + 1]
    drafter.extend([301])
    drafter.propose(2)
    assert rows[-1] == 1  # within a generation the cache is reused either way


@pytest.fixture(scope="module")
def drafting(stories_dir):
    """stories260K drafting for itself: every draft is accepted."""
    return cullama.Llama.from_pretrained(stories_dir, device="cpu", draft_model=stories_dir)


@pytest.mark.parametrize("reuse_cache", [False, True])
def test_speculative_generation_prefills_the_draft_once_then_two_rows_a_step(drafting, monkeypatch, reuse_cache):
    first = drafting.generate(PROMPT, max_new_tokens=12, ignore_eos=True, speculative="draft", draft_tokens=4)
    held = list(drafting.draft.runner.cached)  # what the draft's cache holds from that generation
    rows = prefilled_rows(drafting.draft.runner, monkeypatch)
    prompt = PROMPT + first.token_ids  # a chat turn: the last text, then more
    out = drafting.generate(prompt, max_new_tokens=16, ignore_eos=True, speculative="draft", draft_tokens=4,
                            reuse_cache=reuse_cache)
    assert out.token_ids == greedy(drafting, 16, prompt)  # the same text either way
    assert out.speculative["accepted"] == out.speculative["drafted"] > 0
    text = prompt + out.token_ids[:1]  # what the first proposal follows
    kept = min(common_prefix(held, text), len(text) - 1)
    assert kept >= len(PROMPT) + 8  # the cache held most of it
    assert rows[0] == (len(text) - kept if reuse_cache else len(text))
    assert len(rows) > 2 and all(r == 2 for r in rows[1:])
