"""tokenizer.json: HuggingFace's ids and chat ids (the shared goldens), streaming == decode for any ids, the files
a checkpoint's tokenizer comes from, and every bad file as one line."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, normalizers, processors

import cullama
from cullama.model.checkpoint import write_random
from cullama.model.config import LlamaConfig
from cullama.common.errors import TokenizerError
from cullama.text.tokenizer import Tokenizer, load_tokenizer
from cullama.text.tokenizer_json import _BYTE_OF_CHAR, JsonStreamDecoder, JsonTokenizer
from tests.conftest import shared_path

FAMILIES = ("tiny-llama3", "tiny-qwen2", "tiny-mistral")


@functools.cache
def golden(name: str) -> tuple[JsonTokenizer, dict]:
    directory = shared_path("golden", name)
    return load_tokenizer(directory), json.loads((directory.parent / f"{name}.golden.json").read_text())


def stream(tok, ids, **options) -> list[str]:
    """Every push() result, then flush()."""
    decoder = tok.stream_decoder(**options)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def copy_golden(name: str, to: Path, files=("tokenizer.json", "tokenizer_config.json")) -> Path:
    for file in files:
        shutil.copy(shared_path("golden", name, file), to / file)
    return to


# -- HuggingFace's ids --------------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_texts_match_autotokenizer(name):
    tok, ref = golden(name)
    assert isinstance(tok, JsonTokenizer) and tok.bos_id == ref["bos_id"]
    assert set(tok.eos_ids) <= set(ref["eos_ids"])
    for case in ref["texts"]:  # BOS from the post-processor (llama3, mistral) or none (qwen2)
        assert tok.encode(case["text"]) == case["ids"], case["text"]
        assert tok.decode(case["ids"]) == case["text"]


@pytest.mark.parametrize("name", FAMILIES)
def test_chats_match_apply_chat_template(name):
    tok, ref = golden(name)
    for case in ref["chats"]:
        assert tok.template.render(case["messages"], tok.special_tokens) == case["text"]
        assert tok.chat_ids(case["messages"]) == case["ids"]


def test_chat_system_argument_is_message_zero():
    tok, ref = golden("tiny-llama3")
    messages = ref["chats"][1]["messages"]
    assert tok.chat_ids(messages[1:], system=messages[0]["content"]) == ref["chats"][1]["ids"]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_text_is_decode_without_special_tokens(name):
    tok, ref = golden(name)
    cases = [c for c in ref["cases"] if max(c["greedy_ids"]) < tok.vocab_size]  # qwen2 pads its vocabulary
    assert cases
    for case in cases:
        assert tok.decode(case["greedy_ids"]) == case["greedy_text"]
        assert "".join(stream(tok, case["greedy_ids"])) == case["greedy_text"]
        assert "".join(stream(tok, case["prompt_ids"])) == tok.decode(case["prompt_ids"])


def test_special_tokens_in_a_text_are_read_as_specials_and_not_shown():
    tok, _ = golden("tiny-llama3")
    ids = tok.encode("hi<|eot_id|>there", bos=False)
    assert 504 in ids and tok.decode(ids) == "hithere"
    assert tok.encode("hi", eos=True)[-1] == tok.eos_id == 504


def test_added_tokens_of_a_tokenizer_json(tmp_path):
    # A fine-tune's added tokens: a special one (hidden in text, a chat marker) and a plain one (shown).
    spec = json.loads(shared_path("golden", "tiny-qwen2", "tokenizer.json").read_text())
    spec["added_tokens"] += [
        {"id": 453, "content": "<tool_call>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False},
        {"id": 454, "content": "<|fim|>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True},
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(tmp_path)
    assert tok.vocab_size == 455
    ids = tok.encode("a<tool_call>b<|fim|>c")
    assert 453 in ids and 454 in ids
    assert tok.decode(ids) == "a<tool_call>bc" == "".join(stream(tok, ids))
    tok.check_fits(512)
    with pytest.raises(TokenizerError, match=r"has 455 pieces but the model has a vocabulary of 454"):
        tok.check_fits(454)


def test_add_bos_token_in_tokenizer_config_decides(tmp_path):
    copy_golden("tiny-llama3", tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    plain = load_tokenizer(tmp_path).encode("Once")
    for flags, expected in [({"add_bos_token": False}, plain[1:]),
                            ({"add_bos_token": True, "add_eos_token": True}, [*plain, 504]),
                            ({"add_eos_token": True}, [*plain[1:], 504])]:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
        assert load_tokenizer(tmp_path).encode("Once") == expected, flags


@pytest.mark.parametrize("setting", [
    {"truncation": {"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": 0}},
    {"padding": {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                 "pad_type_id": 0, "pad_token": "!"}},
    {"padding": {"strategy": "BatchLongest", "direction": "Left", "pad_to_multiple_of": 8, "pad_id": 0,
                 "pad_type_id": 0, "pad_token": "!"}},
])
def test_truncation_and_padding_saved_in_the_file_change_no_id(tmp_path, setting):
    # A tokenizer.json saved after enable_truncation / enable_padding carries them; transformers' encode and
    # apply_chat_template switch both off on every call unless asked (set_truncation_and_padding), so its ids
    # are the whole text's, unpadded (issue 30 item 1: max_length 2 made a 42-token prompt 2 ids).
    copy_golden("tiny-llama3", tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps({**spec, **setting}))
    tok, ref = load_tokenizer(tmp_path), golden("tiny-llama3")[1]
    for case in ref["texts"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    for case in ref["chats"]:
        assert tok.chat_ids(case["messages"]) == case["ids"]
    assert tok.encode("") == [tok.bos_id]


# -- streaming ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def byte_fallback(tmp_path_factory) -> JsonTokenizer:
    """A LLaMA-2-style tokenizer.json: "▁" pieces, byte fallback, a decoder that strips the first space."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "a", "b", "e", "h", "t", "▁t", "▁th", "▁the", "▁a", "é", "日"]:
        vocab[piece] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[("▁", "t"), ("▁t", "h"), ("▁th", "e"), ("▁", "a")],
                                 unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory = tmp_path_factory.mktemp("byte_fallback")
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return load_tokenizer(directory)


def byte_ids(tok: JsonTokenizer) -> list[int]:
    """The ids that stand for one byte: byte-fallback pieces, or byte-level BPE's 256 first tokens."""
    return sorted(tok._byte_ids) or list(range(256))


def random_ids(tok: JsonTokenizer, rng: np.random.Generator, n: int) -> list[int]:
    """Mostly single bytes, so that characters get split and invalid UTF-8 is common; some special tokens."""
    pools = byte_ids(tok), [b for b in byte_ids(tok) if tok.decode([b]) == "\ufffd"], \
        sorted(tok._special_ids), list(range(tok.vocab_size))
    kinds = rng.choice(len(pools), size=n, p=[0.35, 0.25, 0.1, 0.3])
    return [int(rng.choice(pools[k])) for k in kinds]


@pytest.fixture(params=[*FAMILIES, "byte_fallback"])
def tokenizer(request) -> JsonTokenizer:
    return request.getfixturevalue("byte_fallback") if request.param == "byte_fallback" else golden(request.param)[0]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_stream_equals_decode_for_random_ids(tokenizer, seed, skip):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        ids = random_ids(tokenizer, rng, int(rng.integers(0, 24)))
        streamed = "".join(stream(tokenizer, ids, skip_special_tokens=skip))
        assert streamed == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_special_tokens_shown_when_asked():
    tok, ref = golden("tiny-llama3")
    ids = ref["chats"][0]["ids"]
    assert tok.decode(ids, skip_special_tokens=False) == ref["chats"][0]["text"]
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == ref["chats"][0]["text"]
    direct = JsonStreamDecoder(tok)  # hidden by default, as by decode
    assert "".join(direct.push(i) for i in ids) + direct.flush() == tok.decode(ids) != ref["chats"][0]["text"]


def test_stream_holds_a_split_character_and_nothing_else():
    tok, _ = golden("tiny-llama3")
    smile = tok.encode("🙂", bos=False)  # four byte tokens: F0 9F 99 82
    once = tok.encode("Once", bos=False)
    assert len(smile) == 4 and [tok.decode([i]) for i in once] == ["O", "n", "ce"]
    assert stream(tok, [*once, *smile, *once]) == ["O", "n", "ce", "", "", "", "🙂", "O", "n", "ce", ""]
    # a lead byte then an ASCII character: the lead byte is U+FFFD as soon as that character arrives
    assert stream(tok, [smile[0], *once]) == ["", "\ufffdO", "n", "ce", ""]
    # a character that never completes is U+FFFD, as decode says, at the end
    assert stream(tok, smile[:3]) == ["", "", "", "\ufffd"] and tok.decode(smile[:3]) == "\ufffd"


def test_byte_fallback_runs_are_held_whole(byte_fallback):
    euro = [3 + b for b in "€".encode()]
    the = byte_fallback.encode(" the", bos=False)
    assert [byte_fallback.piece(i) for i in the] == ["▁", "▁the"]
    # a run shows once a piece that is not a byte ends it
    assert stream(byte_fallback, [*euro, *the]) == ["", "", "", "€ ", " the", ""]
    # one byte that makes the run invalid turns every byte of it into U+FFFD: nothing of it could show early
    assert stream(byte_fallback, [*euro, 3 + 0xFF, *the]) == ["", "", "", "", "\ufffd" * 4 + " ", " the", ""]
    # the first space is stripped, as decode strips it, and only the first
    assert stream(byte_fallback, [*the, *euro]) == ["", " the", "", "", "", "€"]
    # a BOS first prints nothing, so the first space is still the text's first
    assert stream(byte_fallback, [byte_fallback.bos_id, the[1], *the]) == ["", "the", " ", " the", ""]


def test_a_special_token_first_leaves_the_first_space_to_the_text(tmp_path):
    # Metaspace drops the first piece's space; a special token before it prints nothing, so the stream must
    # not stand the history in for it yet ("x" would: "x the" -> " the").
    pieces = HFTokenizer(models.WordLevel(vocab={"<unk>": 0, "<s>": 1, "\u2581the": 2, "\u2581cat": 3, "x": 4},
                                          unk_token="<unk>"))
    pieces.decoder = decoders.Metaspace()
    pieces.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>")])
    pieces.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok._filler == 4 and tok.decode([1, 2, 3]) == "the cat"
    assert stream(tok, [1, 2, 3]) == ["", "the", " cat", ""]


def test_a_token_that_does_not_decode_as_itself_twice_never_stands_in_for_the_history(tmp_path):
    # CTC's decoder merges a repeated token ("a", "a" -> "a"): standing in for the text before it, "a" would
    # swallow the next "a". No token here qualifies, so the stream keeps its history, and still equals decode.
    ctc = HFTokenizer(models.WordLevel(vocab={"<pad>": 0, "a": 1, "b": 2, "<unk>": 3}, unk_token="<unk>"))
    ctc.decoder = decoders.CTC(pad_token="<pad>")
    ctc.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    ids = [2, 1, 0, 1, 1, 2]
    assert tok.decode(ids) == "baab" == "".join(stream(tok, ids))


def test_stream_work_stays_bounded():
    # Bytes that never make characters: only the unfinished tail stays pending.
    tok, _ = golden("tiny-qwen2")
    rng = np.random.default_rng(5)
    bad = [b for b in range(256) if tok.decode([b]) == "\ufffd"]
    ids = [int(rng.choice(bad)) for _ in range(2000)]
    decoder, text, longest = tok.stream_decoder(), "", 0
    for i in ids:
        text += decoder.push(i)
        longest = max(longest, len(decoder._pending))
    assert longest <= 4 and text + decoder.flush() == tok.decode(ids)  # a UTF-8 character's bytes at most
    # Text that shows: the history is one token that says the same.
    ids = tok.encode("the cat sat on the mat " * 20, bos=False)
    assert "".join(decoder.push(i) for i in ids) == tok.decode(ids) and decoder._context == [tok._filler]


def test_a_byte_level_tokenizer_without_a_stand_in_keeps_its_history(tmp_path):
    # Only the bytes 0x80 .. 0xFF, each U+FFFD alone: no token is a stand-in, and bytes that never make a
    # character stay pending (correct, if slower) instead of being cut down.
    upper = [c for c, b in _BYTE_OF_CHAR.items() if b >= 0x80]
    spec = HFTokenizer(models.WordLevel(vocab={c: i for i, c in enumerate(upper)}, unk_token=upper[0]))
    spec.decoder = decoders.ByteLevel()
    spec.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert tok._filler is None
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 128, 50)]
    assert "".join(stream(tok, ids)) == tok.decode(ids)


@pytest.mark.parametrize("skip", [True, False])
def test_prime_is_pushing_the_prompt(tokenizer, skip):
    """prime(prompt) returns what pushing each prompt id returns together, and leaves the decoder where they leave it:
    the completion's pieces are the same, and prompt text + completion text is decode(prompt + completion)."""
    rng = np.random.default_rng(11)
    for _ in range(150):
        prompt, completion = (random_ids(tokenizer, rng, int(rng.integers(0, 16))) for _ in range(2))
        pushed, primed = (tokenizer.stream_decoder(skip_special_tokens=skip) for _ in range(2))
        before = "".join(pushed.push(i) for i in prompt)
        assert primed.prime(prompt) == before, prompt
        after = [primed.push(i) for i in completion] + [primed.flush()]
        assert after == [pushed.push(i) for i in completion] + [pushed.flush() if completion else ""], completion
        if completion:
            assert before + "".join(after) == tokenizer.decode(prompt + completion, skip_special_tokens=skip)


def test_a_completion_keeps_its_first_space_after_a_prompt(byte_fallback, tmp_path):
    """LLaMA-2's tokenizer.json (Strip) and a Metaspace decoder strip the text's first space only: after a prompt,
    the completion's first piece keeps it, as transformers' decode(prompt + completion)[len(decode(prompt)):]."""
    prompt, completion = byte_fallback.encode("the"), byte_fallback.encode(" the a", bos=False)
    decoder = byte_fallback.stream_decoder()
    assert decoder.prime(prompt) == "the" == byte_fallback.decode(prompt)
    read = "".join(decoder.push(i) for i in completion) + decoder.flush()
    assert read == byte_fallback.decode(prompt + completion)[len("the"):] == "  the a"
    assert "".join(stream(byte_fallback, completion)) == " the a"  # alone: its first space is the text's
    pieces = HFTokenizer(models.WordLevel(vocab={"<unk>": 0, "<s>": 1, "\u2581the": 2, "\u2581cat": 3, "x": 4},
                                          unk_token="<unk>"))
    pieces.decoder = decoders.Metaspace()
    pieces.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in ("<unk>", "<s>")])
    pieces.save(str(tmp_path / "tokenizer.json"))
    metaspace = load_tokenizer(tmp_path).stream_decoder()
    assert metaspace.prime([1, 2]) == "the" and metaspace.push(3) == " cat"
    after_bos = load_tokenizer(tmp_path).stream_decoder()
    assert after_bos.prime([1]) == "" and after_bos.push(3) == "cat"  # nothing before it: the text's first


def test_out_of_range_id(tokenizer):
    with pytest.raises(TokenizerError, match=f"token id {tokenizer.vocab_size} is outside .*tokenizer.json"):
        tokenizer.decode([5, tokenizer.vocab_size])
    with pytest.raises(TokenizerError, match="token id -1"):
        tokenizer.stream_decoder().push(-1)


# -- which files, and bad ones ------------------------------------------------------------------


def test_tokenizer_json_is_preferred_to_tokenizer_model(tmp_path):
    copy_golden("tiny-llama3", tmp_path)
    shutil.copy(shared_path("tokenizers", "llama2", "tokenizer.model"), tmp_path / "tokenizer.model")
    assert isinstance(load_tokenizer(tmp_path), JsonTokenizer)
    assert isinstance(load_tokenizer(tmp_path, override=tmp_path / "tokenizer.model"), Tokenizer)
    (tmp_path / "tokenizer.json").unlink()
    assert isinstance(load_tokenizer(tmp_path), Tokenizer)


@pytest.mark.parametrize("content, why", [  # the library's own words, and where in the file
    (b"", "at line 1 column 0"),
    (b'{"version": "1.0"}', "at line 1 column 18"),
    (b'{"model": {"type": "BPE", "vocab": 5}}', "at line 1 column 38"),
    (b'{"model": ' * 5000 + b"1" + b"}" * 5000, "at line 1 column"),
    (b"\xff\xfe", "(invalid UTF-8 at byte 0)"),
    (b'{"version": "' + b"k" * 300 + b'"}', "(Unknown tokenizer version '" + "k" * 173 + "; a newer"),  # 200 characters
])
def test_unreadable_tokenizer_json_is_one_line(tmp_path, content, why):
    (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'tokenizer.json'} is not a tokenizer.json") and "\n" not in message
    assert why in message
    if "tokenizers" in message:  # the library's own refusal names the release that refused (an older one may be why)
        import tokenizers

        assert f"that tokenizers {tokenizers.__version__} can read" in message
        assert "pip install -U tokenizers" in message


def test_oversized_tokenizer_json_is_refused(tmp_path):
    with open(tmp_path / "tokenizer.json", "wb") as fh:
        fh.truncate(65 * 1024 * 1024)  # sparse: takes no disk
    with pytest.raises(TokenizerError, match="larger than 64 MiB"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize("config, why", [
    ({"eos_token": "<|nope|>"}, 'eos_token "<|nope|>" is not a token of'),
    ({"bos_token": 5}, "bos_token must be a string, got 5"),
    ({"eos_token": "<\ud800>"}, 'eos_token "<\\ud800>" is not valid Unicode (it holds a lone surrogate)'),
    ({"add_bos_token": "yes"}, "add_bos_token must be true or false"),
    ({"chat_template": [{"name": "tool_use", "template": "x"}]}, "none named \"default\""),
    ({"chat_template": "{% for %}"}, "the chat template does not compile"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_tokenizer_config_is_one_line(tmp_path, config, why):
    copy_golden("tiny-llama3", tmp_path, files=("tokenizer.json",))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(tmp_path)
    assert str(info.value).startswith(str(tmp_path / "tokenizer_config.json")) and why in str(info.value)
    assert "\n" not in str(info.value)


def test_a_post_processor_id_outside_the_vocabulary_is_refused_naming_it(tmp_path):
    # issue 30 item 8: it failed at the model, as "token id 99999 is outside the vocabulary [0, 506)"
    copy_golden("tiny-llama3", tmp_path)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"]["processors"][1]["special_tokens"]["<|begin_of_text|>"]["ids"] = [99999]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(tmp_path)
    assert str(info.value) == (f"{tmp_path / 'tokenizer.json'}: its post_processor adds token id 99999, outside "
                               "its vocabulary [0, 506)")


def test_special_tokens_map_json_fills_in(tmp_path):
    copy_golden("tiny-llama3", tmp_path, files=("tokenizer.json",))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|eot_id|>"}}))
    assert load_tokenizer(tmp_path).eos_ids == (504,)


def test_vocabulary_mismatch_is_refused_before_the_weights_load(tmp_path):
    cfg = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_seq_len=64, name="small")
    write_random(tmp_path, cfg, seed=1)
    copy_golden("tiny-llama3", tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not weights")  # never read: the tokenizer is refused first
    with pytest.raises(TokenizerError, match=r"tokenizer.json has 506 pieces but the model has a vocabulary of 400"):
        cullama.Llama.from_pretrained(tmp_path, device="cpu")


# -- end to end: LLaMA-3-shaped ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama3():
    return cullama.Llama.from_pretrained(shared_path("golden", "tiny-llama3"), device="cpu")


def test_llama3_end_to_end(llama3):
    tok, ref = golden("tiny-llama3")
    assert llama3.eos_ids == tuple(ref["eos_ids"])  # config.json's and generation_config.json's, then the tokenizer's
    assert [llama3.encode(t["text"]) for t in ref["texts"]] == [t["ids"] for t in ref["texts"]]
    assert [llama3.chat_ids(c["messages"]) for c in ref["chats"]] == [c["ids"] for c in ref["chats"]]
    for case in ref["cases"]:
        assert min(case["greedy_top1_margins"]) > 0.05  # no near-tie: FP16 picks HF's FP32 token
        result = llama3.generate(case["prompt_ids"], max_new_tokens=24, ignore_eos=True)
        assert result.token_ids == case["greedy_ids"] and result.text == case["greedy_text"]


def test_llama3_chat_through_the_cli(llama3):
    from click.testing import CliRunner
    from cullama.cli.main import main

    _, ref = golden("tiny-llama3")
    message = ref["chats"][0]["messages"][0]["content"]
    result = CliRunner().invoke(main, ["generate", "--model", str(shared_path("golden", "tiny-llama3")), "--device",
                                       "cpu", "--chat", "--max-new-tokens", "2", "--json", message])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["prompt_ids"] == ref["chats"][0]["ids"]


def test_llama3_chat_through_the_server(llama3):
    from cullama.server.app import prepare
    from cullama.server.protocol import ChatRequest

    _, ref = golden("tiny-llama3")
    body = ChatRequest.model_validate({"messages": ref["chats"][1]["messages"], "max_tokens": 4})
    ids, _, _ = prepare(llama3, body, chat=True, speculative={})
    assert ids == ref["chats"][1]["ids"]


# -- each token's bytes (the server's log-probabilities) ---------------------------------------------------------


def test_token_bytes_spell_the_text(tokenizer):
    """Without specials, a text's tokens' bytes joined are the text's UTF-8 (byte-level BPE), or it after the
    space the normalizer prepends (SentencePiece-style pieces): every family and byte-fallback runs ('日' is a piece,
    '€' three byte pieces)."""
    for text in ("the cat sat", "Hello, wörld! 日本 €5", "  two  spaces\nand a line"):
        ids = tokenizer.encode(text, bos=False)
        joined = b"".join(tokenizer.token_bytes(i) for i in ids)
        assert joined in (text.encode(), b" " + text.encode()), (text, joined)


def test_token_bytes_of_specials_and_unknown_ids():
    tok, _ = golden("tiny-llama3")
    assert tok.token_bytes(tok.eos_ids[0]) == tok.piece(tok.eos_ids[0]).encode()  # '<|...|>' as its text
    space_hello = tok.encode(" hello", bos=False)
    assert b"".join(tok.token_bytes(i) for i in space_hello) == b" hello"
    assert any(tok.piece(i).startswith("\u0120") for i in space_hello)  # 'Ġ' is the byte 0x20


def test_an_id_no_token_has_has_no_piece_and_no_bytes(tmp_path):
    words = HFTokenizer(models.WordLevel(vocab={"<unk>": 0, "a": 1, "c": 3}, unk_token="<unk>"))  # no id 2
    words.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert repr(tok) == f"JsonTokenizer({str(tmp_path / 'tokenizer.json')!r}, vocab_size=4)"
    assert tok.piece(2) is None and tok.token_bytes(2) == b"" and tok.token_bytes(3) == b"c"


def test_a_byte_level_piece_with_a_character_outside_gpt2s_table_spells_it_as_a_question_mark(tmp_path):
    pieces = HFTokenizer(models.WordLevel(vocab={"<unk>": 0, "\u0120a\u20ac": 1}, unk_token="<unk>"))  # 'Ġa€'
    pieces.decoder = decoders.ByteLevel()
    pieces.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(tmp_path).token_bytes(1) == b" a?"


def test_the_byte_level_table_is_gpt2s():
    from tokenizers import pre_tokenizers
    assert set(_BYTE_OF_CHAR) == set(pre_tokenizers.ByteLevel.alphabet()) and sorted(_BYTE_OF_CHAR.values()) == \
        list(range(256))
    # printable Latin-1 stands for itself; the rest from U+0100 on, in byte order: 'Ġ' is the space, 'Ń' U+00AD
    assert {c: _BYTE_OF_CHAR[c] for c in "!~\u00a1\u00ac\u00ae\u00ff\u0100\u0120\u0121\u0142\u0143"} == {
        "!": 0x21, "~": 0x7E, "\u00a1": 0xA1, "\u00ac": 0xAC, "\u00ae": 0xAE, "\u00ff": 0xFF, "\u0100": 0x00,
        "\u0120": 0x20, "\u0121": 0x7F, "\u0142": 0xA0, "\u0143": 0xAD}


def test_server_log_probability_texts_use_token_bytes():
    from cullama.server.logprobs import TokenTexts
    tok, _ = golden("tiny-llama3")
    texts = TokenTexts(tok)
    pieces = [texts(i) for i in tok.encode(" hello wörld", bos=False)]
    assert b"".join(bytes(data) for _, data in pieces) == " hello wörld".encode()
    assert pieces[0] == (" h", list(b" h"))  # a whole-character token: its text (the piece 'Ġh' before)
    assert any(text.startswith("bytes:") for text, _ in pieces)  # 'ö' split across tokens: OpenAI's spelling
