"""Drafters for speculative decoding: where the tokens a verify step checks come from.

A drafter follows one generation's text (the prompt, then every token the target model produced)
and proposes the tokens it expects next; the target's verify step keeps the longest prefix it agrees
with and adds its own next token. Drafts decide how many target passes a text takes, never which
text greedy decoding produces.

    drafter.reset(prompt_ids)     # a new generation
    drafter.extend(ids)           # tokens the target produced, in order (the first one included)
    drafts = drafter.propose(k)   # at most k ids to follow the text; [] when it has no guess

- PromptLookup ("ngram"): the tokens that followed the most recent earlier occurrence of the text's
  last n tokens (n = 3, 2, 1) in the prompt and the text so far, found in a dict in O(1).
- DraftModel ("draft"): k greedy steps of a smaller LLaMA with the same tokenizer, run by cullama
  itself (its own PlanRunner, backend and KV cache).
- Replay ("replay"): drafts a given continuation; with the target's own greedy output every draft is
  accepted (the benchmark's upper bound, and tests).
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence

from ..common.errors import ConfigError
from ..runtime.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, seed=0)  # drafts are the draft model's argmax


class Drafter(Protocol):
    name: str  # "ngram", "draft", "replay": the method the statistics name

    def reset(self, prompt_ids: Sequence[int]) -> None: ...

    def extend(self, ids: Sequence[int]) -> None: ...

    def propose(self, k: int) -> list[int]: ...


class PromptLookup:
    """N-gram prompt lookup over the prompt and the text so far.

    `_after[gram]` is the position just after the most recent occurrence of `gram` (a tuple of 1 to
    `max_n` ids) that already has a token after it. Appending a token records the n-grams that end
    just before it, whose follower it is, so each token costs max_n dict writes; the text's own
    last n-gram has no follower yet, so a lookup only ever finds an earlier occurrence. A proposal
    is max_n dict reads and k list reads, whatever the length of the text.
    """

    name = "ngram"

    def __init__(self, max_n: int = 3):
        self.max_n = max_n
        self.tokens: list[int] = []  # the prompt, then every produced token
        self._after: dict[tuple[int, ...], int] = {}

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.tokens, self._after = [], {}
        self.extend(prompt_ids)

    def extend(self, ids: Sequence[int]) -> None:
        for token in ids:
            i = len(self.tokens)
            for n in range(1, min(self.max_n, i) + 1):
                self._after[tuple(self.tokens[i - n:i])] = i
            self.tokens.append(int(token))

    def propose(self, k: int) -> list[int]:
        """The k tokens after the longest matching n-gram's latest occurrence; [] when none matches.

        Where that continuation runs into the end of the text it goes on with its own first tokens:
        a text that repeats with period p is predicted to keep repeating, however large k is."""
        end = len(self.tokens)
        for n in range(min(self.max_n, end), 0, -1):
            start = self._after.get(tuple(self.tokens[end - n:end]))
            if start is not None:
                break
        else:
            return []
        drafts: list[int] = []
        for j in range(k):
            source = start + j
            drafts.append(self.tokens[source] if source < end else drafts[source - end])
        return drafts


class Replay:
    """Drafts `continuation`, the ids that follow the prompt, from where the text has got to."""

    name = "replay"

    def __init__(self, continuation: Sequence[int]):
        self.continuation = [int(t) for t in continuation]
        self.produced = 0  # tokens the target produced so far in this generation

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.produced = 0

    def extend(self, ids: Sequence[int]) -> None:
        self.produced += len(ids)

    def propose(self, k: int) -> list[int]:
        return self.continuation[self.produced:self.produced + k]


class DraftModel:
    """k greedy tokens from a smaller model's own runner, which follows the accepted text.

    Its KV cache follows the text through PlanRunner.start(text, reuse=True): the cache rows past the
    longest prefix it shares with the text (the rejected drafts) are simply written over, so after a
    verify only the new row(s) are prefilled (the target's token, and the last draft when every draft
    was accepted). That is the rollback, at the cost of one prefill pass of one or two rows and k - 1
    decode steps per proposal (and host work in start() that grows with the text: it compares the ids
    with the cached ones and marks them seen). Unless `reuse_cache` (a chat turn), the first proposal of a generation
    prefills from scratch, so a run's drafts do not depend on what the last generation left behind."""

    name = "draft"

    def __init__(self, runner, reuse_cache: bool = False):
        self.runner = runner  # the draft's PlanRunner
        self.reuse_cache = reuse_cache
        self.text: list[int] = []
        self._fresh = True

    def reset(self, prompt_ids: Sequence[int]) -> None:
        self.text, self._fresh = [int(t) for t in prompt_ids], not self.reuse_cache

    def extend(self, ids: Sequence[int]) -> None:
        self.text.extend(int(t) for t in ids)

    def propose(self, k: int) -> list[int]:
        # start() caches the text (len(text) < max_seq_len); each later step writes one more row
        k = min(k, self.runner.max_seq_len - len(self.text) + 1)
        if k <= 0 or len(self.text) >= self.runner.max_seq_len:
            return []
        drafts = [self.runner.start(self.text, GREEDY, reuse=not self._fresh)]
        self._fresh = False
        while len(drafts) < k:
            drafts.append(self.runner.next(ahead=len(drafts) + 1 < k))  # the draft's steps back to back
        return drafts


def check_draft_vocabulary(draft_path: str | os.PathLike, draft_vocab: int, target_vocab: int,
                           draft_tokenizer=None, target_tokenizer=None) -> None:
    """ConfigError, one line, when a draft cannot speak the target's tokens: another vocabulary size,
    or (when both have a tokenizer) a piece that differs."""
    if draft_vocab != target_vocab:
        raise ConfigError(f"draft model {draft_path}: its vocabulary has {draft_vocab} tokens and the target's "
                          f"{target_vocab}; a draft model must use the target's tokenizer")
    if draft_tokenizer is None or target_tokenizer is None:
        return
    if draft_tokenizer.vocab_size != target_tokenizer.vocab_size:
        raise ConfigError(f"draft model {draft_path}: {draft_tokenizer.path} has {draft_tokenizer.vocab_size} "
                          f"pieces and the target's {target_tokenizer.path} {target_tokenizer.vocab_size}")
    for i in range(target_tokenizer.vocab_size):
        ours, theirs = draft_tokenizer.piece(i), target_tokenizer.piece(i)
        if ours != theirs:
            raise ConfigError(f"draft model {draft_path}: token {i} is {ours!r} in {draft_tokenizer.path} but "
                              f"{theirs!r} in the target's {target_tokenizer.path}; a draft model must use the "
                              f"target's tokenizer")
