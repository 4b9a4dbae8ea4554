"""Tokenizer: LLaMA-2 ids, streaming == decode for any ids, the chat template, error messages."""

from __future__ import annotations

import functools
import io
import re
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm

from cullama.common.errors import OptionError, PromptError, TokenizerError
from cullama.text.tokenizer import Tokenizer, load_tokenizer

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
LLAMA2_MODEL = SHARED / "tokenizers" / "llama2" / "tokenizer.model"

# Non-ASCII on purpose: accents, CJK, an emoji (4 bytes), and "€ß" that the tiny model only
# knows as byte-fallback pieces.
TEXTS = ["Hello world", "naïve café 日本語 😀", "  two  spaces", "€ß\n\t🦙🦙 end "]


@pytest.fixture(scope="module")
def llama() -> Tokenizer:
    if not LLAMA2_MODEL.is_file():
        reason = f"../shared/tokenizers/llama2/tokenizer.model not found: {LLAMA2_MODEL}"
        pytest.skip(reason)
    return Tokenizer(LLAMA2_MODEL)


def train(directory: Path, **options) -> Tokenizer:
    """A 320-piece BPE model with byte fallback, trained here so the tests need no shared data."""
    lines = ["the naive cafe serves naïve café au lait", "日本語 のテキスト と 😀 emoji", "hello world"]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines * 20),
        model_writer=model,
        vocab_size=320,
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
        **options,
    )
    (directory / "tokenizer.model").write_bytes(model.getvalue())
    return Tokenizer(directory / "tokenizer.model")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tokenizer:
    # Normalized like LLaMA-2's model: no NFKC, whitespace kept as written.
    directory = tmp_path_factory.mktemp("tiny")
    return train(directory, normalization_rule_name="identity", remove_extra_whitespaces=False)


@pytest.fixture(scope="session")
def tiny_squeezed(tmp_path_factory) -> Tokenizer:
    # sentencepiece's defaults squeeze whitespace, and then decode drops *every* leading "▁".
    return train(tmp_path_factory.mktemp("tiny_squeezed"))


@pytest.fixture(params=["llama", "tiny"])
def tok(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


def stream(tok: Tokenizer, ids) -> list[str]:
    """Every push() result, then flush()."""
    decoder = tok.stream_decoder()
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# -- encode / decode ---------------------------------------------------------------------------


def test_llama2_known_ids(llama):
    # Ids as sentencepiece itself gives them for this model.
    assert (llama.vocab_size, llama.bos_id, llama.eos_id) == (32000, 1, 2)
    assert llama.encode("Hello world") == [1, 15043, 3186]
    assert llama.encode("Hello world", bos=False, eos=True) == [15043, 3186, 2]
    assert llama.piece(15043) == "▁Hello" and llama.piece(3 + 0xE2) == "<0xE2>"
    assert llama.decode([1, 15043, 3186, 2]) == "Hello world"
    assert llama.decode([29871, 15043]) == " Hello"  # only the first "▁" is dropped


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text


def test_control_pieces_are_ids_never_text(tok):
    assert tok.bos_id not in tok.encode("<s> hi </s>", bos=False)
    assert tok.eos_id not in tok.encode("<s> hi </s>", bos=False)
    assert tok.decode([tok.bos_id, tok.eos_id]) == ""


def test_out_of_range_id(tok):
    with pytest.raises(TokenizerError, match=f"token id {tok.vocab_size} .*{tok.path.name}"):
        tok.decode([5, tok.vocab_size])
    with pytest.raises(TokenizerError, match="token id -1"):
        tok.stream_decoder().push(-1)


# -- streaming ---------------------------------------------------------------------------------


@functools.cache
def id_pools(tok: Tokenizer) -> tuple[list[int], ...]:
    """Byte-fallback ids, lead bytes of multi-byte characters, controls, "▁", and every id."""
    byte_ids = [i for i in range(tok.vocab_size) if tok.piece(i).startswith("<0x")]
    lead = [b for b in byte_ids if int(tok.piece(b)[3:5], 16) >= 0xC0]
    space = [i for i in range(tok.vocab_size) if tok.piece(i) == "▁"]
    return byte_ids, lead, [0, tok.bos_id, tok.eos_id], space, list(range(tok.vocab_size))


def random_ids(tok: Tokenizer, rng: np.random.Generator, n: int) -> list[int]:
    """Mostly byte-fallback ids, so that characters get split and invalid UTF-8 is common."""
    pools = id_pools(tok)
    kinds = rng.choice(len(pools), size=n, p=[0.45, 0.15, 0.1, 0.1, 0.2])
    return [int(rng.choice(pools[k])) for k in kinds]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["llama", "tiny", "tiny_squeezed"])
def test_stream_equals_decode_for_random_ids(request, name, seed):
    tok = request.getfixturevalue(name)
    rng = np.random.default_rng(seed)
    for _ in range(250):
        ids = random_ids(tok, rng, int(rng.integers(0, 24)))
        assert "".join(stream(tok, ids)) == tok.decode(ids), ids


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("bos", [True, False])
def test_stream_of_valid_text(tok, text, bos):
    ids = tok.encode(text, bos=bos, eos=True)
    chunks = stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids)
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_stream_holds_split_characters_and_emits_the_rest_at_once(llama):
    euro = [3 + b for b in "€".encode()]  # <0xE2> <0x82> <0xAC>
    hello = llama.encode("Hello", bos=False)
    chunks = stream(llama, [1, *hello, *euro, *hello, 2])
    assert chunks == ["", "Hello", "", "", "€", " Hello", "", ""]
    # A character that never completes is U+FFFD per byte, as decode says, but only at the end.
    assert stream(llama, euro[:2]) == ["", "", "\ufffd\ufffd"]
    # A lead byte followed by a non-continuation byte is invalid as soon as that byte arrives.
    assert stream(llama, [euro[0], 3 + ord("A")]) == ["", "\ufffdA", ""]


def test_stream_work_stays_bounded(llama):
    # Re-decoding only what is not final: the held-back ids never grow with the length.
    decoder = llama.stream_decoder()
    ids = random_ids(llama, np.random.default_rng(7), 3000)
    text = "".join(decoder.push(i) for i in ids)
    assert len(decoder._pending) <= 3 and len(decoder._context) <= 1
    assert text + decoder.flush() == llama.decode(ids)


# -- a completion in its prompt's context ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["llama", "tiny", "tiny_squeezed"])
def test_prime_is_pushing_the_prompt(request, name, seed):
    """prime(prompt) returns what pushing each prompt id returns together, and leaves the decoder where they leave it:
    the completion's pieces are the same, and prompt text + completion text is decode(prompt + completion)."""
    tok = request.getfixturevalue(name)
    rng = np.random.default_rng(seed)
    for _ in range(150):
        prompt, completion = (random_ids(tok, rng, int(rng.integers(0, 16))) for _ in range(2))
        pushed, primed = tok.stream_decoder(), tok.stream_decoder()
        before = "".join(pushed.push(i) for i in prompt)
        assert primed.prime(prompt) == before, prompt
        after = [primed.push(i) for i in completion] + [primed.flush()]
        assert after == [pushed.push(i) for i in completion] + [pushed.flush() if completion else ""], completion
        if completion:
            assert before + "".join(after) == tok.decode(prompt + completion)


@pytest.mark.parametrize("text", TEXTS)
def test_a_completion_reads_as_transformers_reads_it_after_its_prompt(tok, text):
    """decode(prompt + completion)[len(decode(prompt)):], transformers' text of a completion: the first piece keeps its
    space ("Hello world" then "▁Hello" reads " Hello", not "Hello"), as vLLM and OpenAI give it."""
    prompt, completion = tok.encode(text), tok.encode("Hello world", bos=False)
    decoder = tok.stream_decoder()
    assert decoder.prime(prompt) == tok.decode(prompt)
    read = "".join(decoder.push(i) for i in completion) + decoder.flush()
    assert read == tok.decode(prompt + completion)[len(tok.decode(prompt)):] == " Hello world"
    bos = tok.stream_decoder()  # after BOS alone the completion is the text's start: no space
    assert bos.prime([tok.bos_id]) == "" and "".join(bos.push(i) for i in completion) == "Hello world"
    empty = tok.stream_decoder()
    assert empty.prime(prompt) == tok.decode(prompt) and empty.flush() == ""  # no tokens, no text


def test_a_character_the_completion_completes_is_the_completions(llama):
    euro = [3 + b for b in "€".encode()]
    prompt = llama.encode("Price:") + euro[:2]
    decoder = llama.stream_decoder()
    assert decoder.prime(prompt) == "Price:"  # the two bytes wait for the third
    assert [decoder.push(euro[2]), decoder.push(llama.encode("5", bos=False)[-1]), decoder.flush()] == \
        ["€", "5", ""] and llama.decode(prompt + euro[2:]) == "Price:€"
    assert llama.stream_decoder().prime([5, llama.vocab_size, 40000]) == llama.decode([5])  # no text: left out


# -- chat template -----------------------------------------------------------------------------


def test_chat_single_turn(tok):
    expected = tok.encode("[INST] What is 2+2? [/INST]")
    assert tok.chat_ids([{"role": "user", "content": "  What is 2+2?\n"}]) == expected


def test_chat_multi_turn_with_system(tok):
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": " Hello! "},
        {"role": "user", "content": "Say <s> twice"},
    ]
    sys_user = "<<SYS>>\nBe brief.\n<</SYS>>\n\nHi"
    expected = (
        tok.encode(f"[INST] {sys_user} [/INST] Hello! ", bos=True, eos=True)
        + tok.encode("[INST] Say <s> twice [/INST]", bos=True, eos=False)
    )
    assert tok.chat_ids(messages, system="Be brief.") == expected
    assert tok.chat_ids([{"role": "system", "content": "Be brief."}, *messages]) == expected
    # BOS/EOS only where the template puts them: "<s>" in the content stays text.
    ids = tok.chat_ids(messages)
    assert [i for i, t in enumerate(ids) if t == tok.bos_id] == [0, ids.index(tok.eos_id) + 1]
    assert ids.count(tok.eos_id) == 1


def msg(role: str, content: str = "x") -> dict:
    return {"role": role, "content": content}


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "no user message"),
        ([msg("assistant")], "message 0 has role 'assistant' where 'user'"),
        ([msg("user"), msg("user")], "message 1 has role 'user' where 'assistant'"),
        ([msg("user"), msg("assistant")], "last .* 'user', not 'assistant'"),
        ([msg("bot")], "message 0 .*role 'bot'"),
        ([{"role": "user", "content": 3}], "message 0 .*int"),
        ([msg("user"), msg("system")], "message 1 has role 'system'"),
    ],
)
def test_chat_rejects_bad_messages(tiny, messages, match):
    with pytest.raises(PromptError, match=match):
        tiny.chat_ids(messages)


@pytest.mark.parametrize("system", [b"Be brief.", 5, ["Be brief."]])
def test_chat_rejects_a_system_prompt_that_is_not_text(tiny, system):
    with pytest.raises(OptionError, match="^system must be a string") as info:
        tiny.chat_ids([msg("user")], system=system)
    assert info.value.option == "system" and info.value.for_cli().startswith("--system must be a string")


def test_chat_rejects_two_system_prompts(tiny):
    with pytest.raises(PromptError, match="system prompt given twice"):
        tiny.chat_ids([msg("system"), msg("user")], system="c")


# -- loading -----------------------------------------------------------------------------------


def test_missing_garbage_and_directory_paths(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(TokenizerError, match=re.escape(f"{missing}: No such file")):
        Tokenizer(missing)
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"\x00not a sentencepiece model\xff" * 10)
    with pytest.raises(TokenizerError, match=re.escape(f"{garbage} is not a SentencePiece")):
        Tokenizer(garbage)
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path))):
        Tokenizer(tmp_path)


@pytest.mark.parametrize("content, why", [
    (b"", "the file is empty"),
    (b"\x08\x01", "not a SentencePiece"),  # a protobuf, but no model in it
])
def test_empty_or_corrupt_model_is_refused_at_load(tmp_path, content, why):
    path = tmp_path / "tokenizer.model"
    path.write_bytes(content)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(tmp_path)
    assert str(path) in str(info.value) and why in str(info.value) and "\n" not in str(info.value)


def test_truncated_and_oversized_models_are_refused(tiny, tmp_path):
    truncated = tmp_path / "truncated.model"
    truncated.write_bytes(tiny.path.read_bytes()[: tiny.path.stat().st_size // 2])
    with pytest.raises(TokenizerError, match=re.escape(f"{truncated} is not a SentencePiece")):
        Tokenizer(truncated)
    huge = tmp_path / "huge.model"
    with open(huge, "wb") as fh:
        fh.truncate(65 * 1024 * 1024)  # sparse: takes no disk
    with pytest.raises(TokenizerError, match="larger than 64 MiB"):
        Tokenizer(huge)


def test_check_fits_the_model_vocabulary(tiny):
    tiny.check_fits(320)
    tiny.check_fits(512)  # a model may have more rows than pieces (padded vocabularies)
    with pytest.raises(TokenizerError) as info:
        tiny.check_fits(256, model="stories260K")
    assert str(info.value).startswith(f"{tiny.path} has 320 pieces but stories260K has a vocabulary of 256")
    assert str(info.value).endswith("with the tokenizer argument)")  # as a Python caller names it
    assert info.value.for_cli().endswith("with --tokenizer)")  # as the CLI prints it


def test_load_tokenizer(tiny, tmp_path):
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(tmp_path)
    assert str(info.value) == f"{tmp_path} has no tokenizer (tokenizer.json or tokenizer.model); name one with " \
                              "the tokenizer argument"
    assert info.value.for_cli().endswith("name one with --tokenizer")
    assert load_tokenizer(tmp_path, override=tiny.path).path == tiny.path
    assert load_tokenizer(tmp_path, override=tiny.path.parent).path == tiny.path  # a directory holding one
    assert load_tokenizer(tiny.path.parent).vocab_size == 320
    with pytest.raises(TokenizerError, match="elsewhere.model"):
        load_tokenizer(tiny.path.parent, override=tmp_path / "elsewhere.model")
