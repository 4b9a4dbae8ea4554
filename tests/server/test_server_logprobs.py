"""`cullama serve`'s log-probability fields end to end (stories260K on the CPU, a real server process): the
chat API's `logprobs` / `top_logprobs`, the legacy completions API's `logprobs` and `echo` (lm-evaluation-harness's
log-likelihood request included), streamed and whole, shaped as OpenAI's and read back by the `openai` client, the
numbers equal to the library's own (`Llama.logprobs`, `Llama.generate(logprobs=...)`) in this process; the fields
that stay refused; and the token texts (server/logprobs.py)."""

from __future__ import annotations

import json
import math

import pytest

from tests.serving import stories_client, stories_oracle, stories_server  # noqa: F401  (fixtures)

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")
pytest.importorskip("openai", reason="the openai client is a test dependency (pip install -e '.[test]')")

from cullama.runtime.logprobs import TokenLogprob  # noqa: E402
from cullama.server.logprobs import NO_PROBABILITY, Logprobs, TokenTexts, number  # noqa: E402  (the serve extra)

MODEL = "stories260K"
# BOS, the first 17 ids of the model's greedy story, then two that are not its picks ("\n" and "L")
STORY = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 13, 438]


def post(server, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = server.request("POST", path, body)
    return status, json.loads(raw)


def lm_eval_loglikelihood(choice: dict, context_length: int) -> tuple[float, bool]:
    """lm-evaluation-harness's LocalCompletionsAPI.parse_logprobs, as it reads an answer (the continuation's
    tokens are those after the context's, the last entry the one token it had generated)."""
    token_logprobs = choice["logprobs"]["token_logprobs"][context_length:-1]
    tops = choice["logprobs"]["top_logprobs"][context_length:-1]
    return sum(token_logprobs), all(lp == max(top.values()) for lp, top in zip(token_logprobs, tops))


# -- /v1/completions: logprobs and echo ------------------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_evaluation_harness_loglikelihood_request(server, oracle, max_tokens):
    """What `lm_eval --model local-completions` sends for a log-likelihood (a batch of one id list, as its
    tokenized requests go; max_tokens 1 today, 0 in its older versions)."""
    body = {"model": MODEL, "prompt": [STORY], "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True}
    status, answer = post(server, "/v1/completions", body)
    assert status == 200, answer
    (choice,) = answer["choices"]
    fields = choice["logprobs"]
    n = len(STORY) + max_tokens
    assert all(len(fields[key]) == n for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"))
    assert fields["token_logprobs"][0] is None and fields["top_logprobs"][0] is None
    expected = oracle.logprobs(STORY, top=1)
    assert fields["token_logprobs"][1:len(STORY)] == [r.logprob for r in expected[1:]]
    assert answer["usage"] == {"prompt_tokens": len(STORY), "completion_tokens": max_tokens,
                               "total_tokens": n, "prompt_tokens_details": {"cached_tokens": 0}}
    if max_tokens:  # lm_eval's reading: the continuation is every prompt token after the context's 10
        total, greedy = lm_eval_loglikelihood(choice, 10)
        assert total == pytest.approx(sum(r.logprob for r in expected[10:]))
        assert not greedy  # the last two ids are not the model's greedy picks
        status, answer = post(server, "/v1/completions", {**body, "prompt": [STORY[:18]]})  # its greedy story
        assert lm_eval_loglikelihood(answer["choices"][0], 10) == (
            pytest.approx(sum(r.logprob for r in expected[10:18])), True)
    assert choice["text"].startswith(oracle.tokenizer.decode(STORY))


def test_completion_logprobs_through_the_openai_client(client, oracle):
    out = client.completions.create(model=MODEL, prompt=STORY[:6], max_tokens=12, temperature=0, logprobs=5)
    expected = oracle.generate(STORY[:6], max_new_tokens=12, logprobs=5)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs == [r.logprob for r in expected.logprobs]
    texts = TokenTexts(oracle.tokenizer)
    assert lp.tokens == [texts(r.token)[0] for r in expected.logprobs]
    for top, record in zip(lp.top_logprobs, expected.logprobs):
        assert top == {texts(t)[0]: v for t, v in record.top}  # greedy: the sampled token is among them
    text = out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, start, end in zip(lp.tokens, lp.text_offset, lp.text_offset[1:] + [len(text)]):
        assert text[start:end] == token  # the first piece's space too: the text is read after the prompt's
    assert text.startswith(" ") and text == oracle.tokenizer.decode(STORY[:6] + expected.token_ids)[
        len(oracle.tokenizer.decode(STORY[:6])):]  # transformers' decode(prompt + completion)[len(decode(prompt)):]


def test_streamed_completion_logprobs_add_up_to_the_whole(server):
    body = {"model": MODEL, "prompt": STORY[:8], "max_tokens": 15, "temperature": 0.9, "seed": 4, "logprobs": 2,
            "echo": True}
    status, whole = post(server, "/v1/completions", body)
    assert status == 200
    chunks = server.sse("/v1/completions", body)
    merged = {key: [] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for chunk in chunks:
        fields = chunk["choices"][0]["logprobs"]
        for key in merged:
            merged[key] += fields[key] if fields else []
    assert merged == whole["choices"][0]["logprobs"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"][0] is None  # the echo comes first


def test_echo_tokens_and_offsets_spell_the_text(server, oracle):
    """An echo's entries, the prompt's and then the completion's: each id's token text, and its text_offset where
    that token's text stands in the choice's text (a control piece has none; the first piece of the prompt, the
    text's first, without its space; the completion's first, read after the prompt's text, with it): the text is
    decode(prompt + completion), not "...there wasa little"."""
    prompt, n = STORY[:8], 8
    status, answer = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                      "temperature": 0, "logprobs": 1, "echo": True})
    assert status == 200, answer
    (choice,) = answer["choices"]
    tokens, offsets, text = choice["logprobs"]["tokens"], choice["logprobs"]["text_offset"], choice["text"]
    texts = TokenTexts(oracle.tokenizer)
    assert tokens == [texts(i)[0] for i in prompt + oracle.generate(prompt, max_new_tokens=6).token_ids]
    spelled = [text[start:end] for start, end in zip(offsets, offsets[1:] + [len(text)])]
    assert spelled == ["", tokens[1].lstrip(" "), *tokens[2:n], *tokens[n:]]
    assert offsets[n] == len(oracle.tokenizer.decode(prompt))
    assert text == oracle.tokenizer.decode(prompt + oracle.generate(prompt, max_new_tokens=6).token_ids)


def test_echo_without_logprobs_is_the_prompt_text(client, oracle):
    out = client.completions.create(model=MODEL, prompt=STORY[:8], max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=STORY[:8], max_tokens=4, temperature=0)
    assert out.choices[0].logprobs is None
    assert out.choices[0].text == oracle.tokenizer.decode(STORY[:8]) + plain.choices[0].text


# -- /v1/chat/completions: logprobs and top_logprobs --------------------------------------------------------

def test_chat_logprobs_whole_and_streamed(client, oracle):
    messages = [{"role": "user", "content": "Tell me a story."}]
    expected = oracle.generate(oracle.chat_ids(messages), max_new_tokens=10, logprobs=3)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    texts = TokenTexts(oracle.tokenizer)
    assert [c.logprob for c in content] == [r.logprob for r in expected.logprobs]
    assert [(c.token, c.bytes) for c in content] == [texts(r.token) for r in expected.logprobs]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == \
        [[(texts(i)[0], lp) for i, lp in r.top] for r in expected.logprobs]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for chunk in chunks for c in (chunk.choices[0].logprobs.content
                                                if chunk.choices[0].logprobs else [])]
    assert streamed == content
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == whole.choices[0].message.content
    bare = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True)
    assert all(c.top_logprobs == [] for c in bare.choices[0].logprobs.content)


@pytest.mark.parametrize("n", [1, 2])
def test_each_streamed_chunks_tokens_spell_its_text(server, oracle, n):
    """Issue 30 item 5: a token whose text a possible stop string held back had its entry in the chunk before its
    text, and the text then came in a chunk with no entries. Each chunk's entries now spell its text (the first
    one's space too: the completion is read after its prompt), as OpenAI streams them; and with n choices (the fourth
    sweep: each choice's chunks had their entries as they came, not with their text), each choice's chunks too."""
    reply = oracle.generate(STORY[:8], max_new_tokens=24, ignore_eos=True)
    surfaces = [oracle.tokenizer.piece(i).replace("\u2581", " ") for i in reply.token_ids]
    held = [k for k, surface in enumerate(surfaces[1:-1], 1) if len(surface.strip()) >= 3 and surface.isascii()]
    assert len(held) >= 3
    stops = [surfaces[k][-2:] + "\a" for k in held[:3]]  # each holds the end of a token back, never matches
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": stops, "n": n}
        if path == "/v1/completions":
            body.update(prompt=STORY[:8], logprobs=0)
        else:  # the chat template's prompt differs: only the spelling is compared
            body.update(messages=[{"role": "user", "content": "Once upon a time"}], logprobs=True)
        every = [chunk["choices"][0] for chunk in server.sse(path, body)]
        for index in range(n):
            chunks = [chunk for chunk in every if chunk["index"] == index]
            *texts, last = [(chunk["text"], (chunk["logprobs"] or {}).get("tokens", [])) if "text" in chunk else
                            (chunk["delta"].get("content"), [bytes(entry["bytes"]).decode() for entry in
                                                             (chunk["logprobs"] or {}).get("content", [])])
                            for chunk in chunks]
            assert last in (("", []), (None, [])) and chunks[-1]["finish_reason"] == "length"
            for i, (text, tokens) in enumerate(texts):
                spelled = "".join(tokens)
                assert spelled == text, (path, index, i, texts)
            if path == "/v1/completions":
                assert "".join(text for text, _ in texts) == reply.text


# -- what stays refused --------------------------------------------------------------------------------

@pytest.mark.parametrize("path,fields,param", [
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt.1"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(server, path, fields, param):
    base = {"prompt": [1, 403]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, answer = post(server, path, {"model": MODEL, "max_tokens": 2, **base, **fields})
    assert status == 400 and answer["error"]["param"] == param, answer


def test_an_echo_longer_than_the_context_is_refused(server):
    status, answer = post(server, "/v1/completions", {"model": MODEL, "prompt": [1] * 513, "max_tokens": 0,
                                                      "echo": True, "logprobs": 0})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"


# -- token texts --------------------------------------------------------------------------------------------

def test_token_texts_and_bytes(oracle):
    texts = TokenTexts(oracle.tokenizer)
    assert texts(403) == (" Once", [32, 79, 110, 99, 101])  # "▁Once": its surface, the space included
    assert texts(13) == ("\n", [10])  # the byte piece <0x0A>
    assert texts(3 + 0xE2) == ("bytes:\\xe2", [0xE2])  # a byte that is part of a character: OpenAI's spelling
    assert texts(1) == ("<s>", list(b"<s>")) and texts(9999) == ("token_id:9999", None)
    assert texts(0) == ("<unk>", list(b"<unk>"))  # the ids from 0 to vocab_size - 1 are the tokenizer's
    assert texts(-1) == ("token_id:-1", None) and texts(512) == ("token_id:512", None)
    assert TokenTexts(None)(5) == ("token_id:5", None)
    assert NO_PROBABILITY == -9999.0


def test_token_texts_of_other_tokenizers():
    class OwnBytes:  # a tokenizer that says its tokens' bytes (byte-level BPE, say)
        vocab_size = 10

        def token_bytes(self, token):
            return b"\xe2\x82" if token == 1 else b" ab"

    class NoPiece:
        vocab_size = 10

        def piece(self, token):
            return None

    assert TokenTexts(OwnBytes())(1) == ("bytes:\\xe2\\x82", [0xE2, 0x82])
    assert TokenTexts(OwnBytes())(2) == (" ab", [32, 97, 98])
    assert TokenTexts(NoPiece())(3) == ("token_id:3", None)


def test_a_log_probability_as_json_takes_it():
    assert number(-2.5) == -2.5 and number(0.0) == 0.0
    assert number(-math.inf) == number(math.nan) == number(-1e5) == NO_PROBABILITY  # JSON has no -inf


def test_an_echo_without_a_tokenizer_is_token_ids_at_offset_0():
    scores = Logprobs(False, 1, True, [1, 5, 9], None)
    record = TokenLogprob(7, -0.5, ((7, -0.5), (2, -1.5)))
    assert scores.prefix == "" and scores.value([record], [None, record, record]) == {
        "tokens": ["token_id:1", "token_id:5", "token_id:9", "token_id:7"],
        "token_logprobs": [None, -0.5, -0.5, -0.5],
        "top_logprobs": [None, {"token_id:7": -0.5}, {"token_id:7": -0.5}, {"token_id:7": -0.5}],
        "text_offset": [0, 0, 0, 0]}
