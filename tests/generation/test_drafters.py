"""Drafters: the n-gram index's lookups (which occurrence, which n, O(1) reads), replay, the draft model's
proposals and cache rollback on stories260K, and the refusal of a draft with another vocabulary."""

import io
import json
import random

import pytest

import cullama
from cullama.model import checkpoint
from cullama.generation import drafters
from cullama.generation.drafters import DraftModel, PromptLookup, Replay
from cullama.common.errors import ConfigError
from tests.conftest import load_golden


def lookup(tokens, max_n=3):
    drafter = PromptLookup(max_n)
    drafter.reset(tokens)
    return drafter


# -- prompt lookup --------------------------------------------------------------------------------
def test_the_most_recent_earlier_occurrence_wins():
    assert lookup([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]).propose(2) == [8, 5]


def test_the_longest_matching_ngram_wins():
    # (1, 2, 3) was followed by 10; the single token 3 more recently by 11
    assert lookup([1, 2, 3, 10, 3, 11, 1, 2, 3]).propose(1) == [10]


def test_a_shorter_ngram_is_tried_when_the_longer_one_never_occurred():
    # (4, 6, 7) never occurred before; (6, 7) did, last followed by 8
    assert lookup([5, 6, 7, 9, 6, 7, 8, 4, 6, 7]).propose(3) == [8, 4, 6]
    assert lookup([5, 6, 7, 9, 6, 7, 8, 4, 6, 7], max_n=1).propose(1) == [8]  # (7,) alone: the same occurrence


def test_no_earlier_occurrence_proposes_nothing():
    assert lookup([1, 2, 3]).propose(4) == []  # the last n-grams are only themselves
    assert lookup([7]).propose(4) == [] and lookup([]).propose(4) == []


def test_a_continuation_that_reaches_the_end_goes_on_with_itself():
    assert lookup([1, 2, 3, 1, 2]).propose(5) == [3, 1, 2, 3, 1]
    assert lookup([4, 4]).propose(3) == [4, 4, 4]


def test_extend_indexes_the_produced_tokens_and_reset_forgets():
    drafter = lookup([1, 2, 3])
    drafter.extend([1, 2])
    assert drafter.propose(2) == [3, 1]
    drafter.extend([5])  # (1, 2, 5) is new; (2, 5) and (5,) too
    assert drafter.propose(2) == []
    drafter.reset([9, 9])
    assert drafter.tokens == [9, 9] and drafter.propose(1) == [9]


class CountingList(list):
    """A list that counts item reads and refuses to be scanned."""

    reads = 0

    def __getitem__(self, index):
        CountingList.reads += 1
        return super().__getitem__(index)

    def __iter__(self):
        raise AssertionError("the history was scanned")


def test_a_proposal_reads_a_few_items_whatever_the_history_length():
    rng = random.Random(0)
    history = [rng.randrange(50) for _ in range(100_000)]
    drafter = lookup(history)
    assert len(drafter._after) <= 3 * len(history)  # at most one entry per n-gram ending at each position
    drafter.tokens = CountingList(drafter.tokens)
    for _ in range(50):
        CountingList.reads = 0
        drafts = drafter.propose(8)
        assert CountingList.reads <= drafter.max_n + 8  # the last n-grams (slices) and the k drafts
        CountingList.reads = 0
        drafter.extend(drafts[:3] + [rng.randrange(50)])
        assert CountingList.reads <= 4 * drafter.max_n  # per token: the n-grams ending just before it


def test_drafts_follow_the_index_against_a_brute_force_search():
    rng = random.Random(1)
    tokens = [rng.randrange(6) for _ in range(400)]
    drafter = lookup([])
    for end, token in enumerate(tokens, start=1):
        drafter.extend([token])
        text = tokens[:end]
        want = []
        for n in (3, 2, 1):
            if n > end:
                continue
            starts = [i for i in range(n, end) if text[i - n:i] == text[end - n:]]  # occurrences with a follower
            if starts:
                start = max(starts)
                for j in range(5):
                    want.append(text[start + j] if start + j < end else want[start + j - end])
                break
        assert drafter.propose(5) == want, end


# -- replay ---------------------------------------------------------------------------------------
def test_replay_drafts_from_where_the_text_has_got_to():
    drafter = Replay([10, 11, 12, 13, 14])
    drafter.reset([1, 2])
    drafter.extend([10])
    assert drafter.propose(3) == [11, 12, 13]
    drafter.extend([11, 12, 99])
    assert drafter.propose(3) == [14]  # the script goes on by position, whatever was produced
    drafter.extend([14])
    assert drafter.propose(3) == []
    drafter.reset([1])
    assert drafter.propose(2) == [10, 11]


# -- the draft model --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stories(stories_dir):
    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


def test_draft_model_proposes_its_greedy_continuation(stories, stories_expected):
    expected = stories_expected["ids"]
    drafter = DraftModel(stories.runner)
    drafter.reset([1])
    drafter.extend(expected[:1])
    assert drafter.propose(4) == expected[1:5]
    drafter.extend(expected[1:4])  # three of four drafts accepted; the target's own token was expected[4]
    drafter.extend(expected[4:5])
    assert drafter.propose(8) == expected[5:13]


def test_draft_model_rolls_back_to_the_accepted_text(stories, stories_dir, stories_expected):
    expected = stories_expected["ids"]
    drafter = DraftModel(stories.runner)
    drafter.reset([1])
    drafter.extend(expected[:3])
    drafter.propose(6)  # the draft's cache now holds rows for drafts that are about to be rejected
    text = [1, *expected[:5], 300]  # two drafts accepted, then a token the draft did not propose
    drafter.extend([*expected[3:5], 300])
    drafts = drafter.propose(5)
    assert stories.runner.cached == text + drafts[:-1]  # rows past the accepted text were rewritten
    fresh = cullama.Llama.from_pretrained(stories_dir, device="cpu")
    assert drafts == fresh.generate(text, max_new_tokens=5).token_ids


def test_draft_model_stays_inside_its_context(stories_dir, stories_expected):
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_seq_len=10)
    drafter = DraftModel(llm.runner)
    drafter.reset([1])
    drafter.extend(stories_expected["ids"][:8])  # 9 ids: start() caches them, one more row is left
    assert drafter.propose(4) == stories_expected["ids"][8:10]
    drafter.extend(stories_expected["ids"][8:9])  # 10 ids: a full context
    assert drafter.propose(4) == []


# -- the vocabulary check -------------------------------------------------------------------------
def test_a_draft_with_another_vocabulary_size_is_refused_before_loading(monkeypatch):
    target, _, _ = load_golden("tiny-mha")
    draft, _, _ = load_golden("tiny-gqa-sharded")
    monkeypatch.setattr(checkpoint, "open_checkpoint", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match=r"draft model .*tiny-gqa-sharded: its vocabulary has 1024 tokens and "
                                          r"the target's 512") as error:
        cullama.Llama.from_pretrained(target, device="cpu", draft_model=draft)
    assert "\n" not in str(error.value)


def trained_tokenizer(vocab_size: int) -> bytes:
    """A SentencePiece model of `vocab_size` pieces that is not stories260K's."""
    import sentencepiece as spm

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 7))) for _ in range(3000)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
                                   model_type="bpe", minloglevel=2)
    return model.getvalue()


def test_a_draft_with_other_pieces_is_refused(stories_dir, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text((stories_dir / "config.json").read_text())
    (tmp_path / "tokenizer.model").write_bytes(trained_tokenizer(512))
    monkeypatch.setattr(checkpoint, "open_checkpoint", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match=r"draft model .*: token \d+ is '.*' in .*tokenizer.model but '.*' in the "
                                          r"target's .*stories260K/tokenizer.model") as error:
        cullama.Llama.from_pretrained(stories_dir, device="cpu", draft_model=tmp_path)
    assert "\n" not in str(error.value)


def test_tokenizers_of_another_size_are_refused():
    class Tok:
        def __init__(self, n, path):
            self.vocab_size, self.path = n, path

    with pytest.raises(ConfigError, match="a.model has 600 pieces and the target's b.model 512"):
        drafters.check_draft_vocabulary("d", 512, 512, Tok(600, "a.model"), Tok(512, "b.model"))


def test_a_draft_without_a_tokenizer_needs_only_the_same_size(stories_dir):
    target, cases, _ = load_golden("tiny-mha")  # vocabulary 512 like stories260K, no tokenizer.model
    llm = cullama.Llama.from_pretrained(target, device="cpu", draft_model=stories_dir)
    assert llm.draft is not None and llm.draft.config.vocab_size == llm.config.vocab_size
    assert llm.draft.runner.max_seq_len == llm.runner.max_seq_len  # the draft follows the target's context
    prompt = cases[0]["prompt_ids"]
    plain = llm.generate(prompt, max_new_tokens=24, ignore_eos=True)
    spec = llm.generate(prompt, max_new_tokens=24, ignore_eos=True, speculative="draft", draft_tokens=3)
    assert spec.token_ids == plain.token_ids and spec.speculative["drafted"] > 0
    assert json.dumps(spec.to_dict())  # the record is plain JSON
