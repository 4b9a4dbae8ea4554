"""`cullama serve` with speculative decoding: one real server process shared by the module (stories260K on the
CPU, drafting for itself with --draft-model, so that every draft is accepted and the tokens come in bursts of
k + 1), driven with raw HTTP and the `openai` client. Whichever way a request drafts, its answer must be the
plain decoding's, token for token and chunk for chunk; /metrics counts the verify steps and the drafted and
accepted tokens by method. Also: `cullama serve`'s speculative flags fail exactly as `cullama generate`'s do."""

from __future__ import annotations

import json
import math
import socket

import pytest
from click.testing import CliRunner

from tests.conftest import load_golden
from tests.serving import openai_client, run_serve, running

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")
pytest.importorskip("openai", reason="the openai client is a test dependency (pip install -e '.[test]')")

MODEL = "stories260K"
ONCE = [1, 403, 407, 261, 378]  # BOS "Once upon a time"
K = 4  # the server's draft tokens per step (the default of --draft-tokens)
GENERATED = "cullama_generation_tokens_total"
COUNTERS = ("steps", "draft_tokens", "accepted_tokens")  # cullama_speculative_<name>_total{method=...}


@pytest.fixture(scope="module")
def server(stories_dir, tmp_path_factory):
    with running(stories_dir, tmp_path_factory.mktemp("serve"), "--draft-model", str(stories_dir)) as proc:
        yield proc


def speculated(before: dict, after: dict, method: str) -> tuple[int, int, int]:
    """(steps, drafted, accepted) of `method` between two /metrics readings."""
    return tuple(int(after[key] - before[key]) for key in
                 (f'cullama_speculative_{name}_total{{method="{method}"}}' for name in COUNTERS))


def whole(server, body: dict, path: str = "/v1/completions") -> dict:
    status, _, raw = server.request("POST", path, {"model": MODEL, "temperature": 0, **body})
    assert status == 200, raw
    return json.loads(raw)


def streamed(server, body: dict) -> tuple[list[str], str, dict]:
    """(the text of each chunk, the finish reason, the usage) of a streamed completion."""
    chunks = server.sse("/v1/completions", {"model": MODEL, "temperature": 0, **body,
                                            "stream_options": {"include_usage": True}})
    choices = [c["choices"][0] for c in chunks[:-1]]
    assert chunks[-1]["choices"] == [] and choices[-1]["text"] == ""  # the finish reason's chunk, then the usage's
    assert all(c["finish_reason"] is None for c in choices[:-1])
    return [c["text"] for c in choices[:-1]], choices[-1]["finish_reason"], chunks[-1]["usage"]


def test_the_server_says_it_drafts_by_default(server):
    # and its prefill chunk: --max-batch 8's for stories260K (plan.batch_prefill_chunk), for `generate --prefill-chunk`
    assert f"is ready on cpu, speculative decoding by default (draft, {K} draft tokens); prefill chunk 64" \
        in server.log()


@pytest.mark.parametrize("fields, method", [({}, "draft"), ({"speculative": "ngram"}, "ngram")],
                         ids=["the server's default: itself as draft", "ngram, asked by the request"])
def test_greedy_completion_from_bos_is_the_documented_text(server, stories_expected, fields, method):
    n = len(stories_expected["ids"])
    before = server.metrics()
    out = whole(server, {"prompt": [1], "max_tokens": n, **fields})
    after = server.metrics()
    assert out["choices"][0]["text"] == stories_expected["text"] and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    steps, drafted, accepted = speculated(before, after, method)
    assert steps + accepted == n - 1 and 0 < drafted <= K * steps  # each step: its accepted drafts and one token
    if method == "draft":
        assert accepted == drafted and steps == math.ceil((n - 1) / (K + 1))  # its own draft: all accepted
    other = "ngram" if method == "draft" else "draft"
    assert speculated(before, after, other) == (0, 0, 0)
    assert after[GENERATED] - before[GENERATED] == n


@pytest.fixture(scope="module")
def plain(server) -> tuple[dict, tuple]:
    """A completion of ONCE without speculation: whole, and streamed."""
    body = {"prompt": ONCE, "max_tokens": 24, "speculative": "off"}
    return whole(server, body), streamed(server, body)


# A request's own speculative fields over the server's default (draft, k = 4): (fields, method, k or None when
# adaptive)
OVERRIDES = [
    ({"speculative": "off"}, None, None),
    ({"draft_tokens": 1}, "draft", 1),
    ({"speculative": "draft", "draft_tokens": 8}, "draft", 8),
    ({"adaptive_draft": True, "draft_tokens": 2}, "draft", None),
    ({"speculative": "ngram", "draft_tokens": 2}, "ngram", 2),
    ({"speculative": None, "draft_tokens": None, "adaptive_draft": None}, "draft", K),  # null: the default
]


@pytest.mark.parametrize("fields, method, k", OVERRIDES, ids=[json.dumps(o[0]) for o in OVERRIDES])
def test_a_request_overrides_the_default_and_streams_the_plain_chunks(server, plain, fields, method, k):
    plain_whole, plain_stream = plain
    n = plain_whole["usage"]["completion_tokens"]
    body = {"prompt": ONCE, "max_tokens": n, **fields}
    before = server.metrics()
    out, stream = whole(server, body), streamed(server, body)
    after = server.metrics()
    assert out["choices"] == plain_whole["choices"] and out["usage"] == plain_whole["usage"]
    # Every token's text in its own chunk, in order, whether it came alone or in a burst.
    assert stream == plain_stream and "".join(stream[0]) == out["choices"][0]["text"]
    assert len(stream[0]) == n  # stories260K spells every one of these tokens with text of its own
    for other in {"ngram", "draft"} - {method}:
        assert speculated(before, after, other) == (0, 0, 0)
    if method is None:
        return
    steps, drafted, accepted = speculated(before, after, method)
    assert steps + accepted == 2 * (n - 1)  # two requests
    if method == "ngram":
        assert drafted <= 2 * k * steps
    elif k is not None:  # its own draft, every draft accepted: ceil((n - 1) / (k + 1)) steps each
        assert accepted == drafted and steps == 2 * math.ceil((n - 1) / (k + 1))
    else:  # adaptive from 2: k grows after each step that accepted all, so fewer steps than a fixed k of 2
        assert accepted == drafted and steps < 2 * math.ceil((n - 1) / 3)
    assert after["cullama_time_between_tokens_seconds_count"] - before["cullama_time_between_tokens_seconds_count"] \
        == 2 * (n - 1)  # a burst's tokens are each timed, as a client sees them arrive


def test_a_stop_string_inside_a_burst_never_leaks(server, stories_expected):
    # " little" " g" "irl" are tokens 8 to 10 from BOS, the end of the second burst (tokens 6 to 10: the
    # first is the prefill's, then k + 1 = 5 per step): the stop string begins and ends inside one burst.
    stop = "le gi"
    body = {"prompt": [1], "max_tokens": 30, "stop": [stop]}
    plain_text, plain_finish, plain_usage = streamed(server, {**body, "speculative": "off"})
    before = server.metrics()
    pieces, finish, usage = streamed(server, body)
    after = server.metrics()
    assert "".join(pieces) == "Once upon a time, there was a litt" and finish == "stop"
    assert (pieces, usage) == (plain_text, plain_usage) and usage["completion_tokens"] == 11
    assert speculated(before, after, "draft") == (2, 2 * K, 2 * K)  # two steps: the burst was cut at "irl"
    out = whole(server, body)
    assert out["choices"][0]["text"] == "".join(pieces) and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"] == usage


def test_a_bursts_log_probabilities_spell_each_chunks_text_as_plain_decodings(server):
    # Issue 30 item 5 under draft-model speculation: a burst's tokens arrive in one verify step, a possible stop
    # string ("le gi", never written: "\a") holds " litt" back; each chunk's entries still spell its text, and the
    # chunks and their entries are plain decoding's.
    body = {"prompt": [1], "max_tokens": 24, "stop": ["le g\a", "ere w\a"], "logprobs": 1}

    def chunks(fields):
        out = server.sse("/v1/completions", {"model": MODEL, "temperature": 0, **body, **fields})
        return [(c["choices"][0]["text"], (c["choices"][0]["logprobs"] or {}).get("tokens", []),
                 (c["choices"][0]["logprobs"] or {}).get("token_logprobs", [])) for c in out]

    drafted, plain = chunks({}), chunks({"speculative": "off"})
    assert [c[:2] for c in drafted] == [c[:2] for c in plain]
    assert [lp for c in drafted for lp in c[2]] == pytest.approx([lp for c in plain for lp in c[2]], abs=1e-5)
    *texts, last = drafted
    assert last[:2] == ("", [])
    for i, (text, tokens, _) in enumerate(texts):
        assert ("".join(tokens).removeprefix(" ") if i == 0 else "".join(tokens)) == text, (i, drafted)
    assert any(len(tokens) > 1 for _, tokens, _ in texts)  # text held back: some chunk spells two tokens


@pytest.mark.parametrize("n", [1, 2, 3, 7, 11])
def test_max_tokens_is_never_exceeded_inside_a_burst(server, stories_expected, n):
    # With k = 4 a burst is 5 tokens: the last step drafts fewer so as to end on the n-th token exactly.
    before = server.metrics()
    out = whole(server, {"prompt": [1], "max_tokens": n})
    pieces, finish, usage = streamed(server, {"prompt": [1], "max_tokens": n})
    after = server.metrics()
    assert out["usage"]["completion_tokens"] == usage["completion_tokens"] == len(pieces) == n
    assert out["choices"][0]["finish_reason"] == finish == "length"
    assert out["choices"][0]["text"] == "".join(pieces) and stories_expected["text"].startswith("".join(pieces))
    assert after[GENERATED] - before[GENERATED] == 2 * n  # counted as generated: no token past n
    steps, drafted, accepted = speculated(before, after, "draft")
    assert steps == 2 * math.ceil((n - 1) / (K + 1)) and accepted == drafted == 2 * (n - 1) - steps


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_a_seeded_sampled_request_is_reproducible(server, method):
    # Speculative sampling keeps the target's distribution, not plain sampling's draws: the same seed gives the
    # same answer again, whole or streamed.
    body = {"prompt": ONCE, "max_tokens": 24, "temperature": 0.9, "top_p": 0.95, "seed": 7, "speculative": method}
    first, again = whole(server, body), whole(server, body)
    assert first["choices"] == again["choices"] and first["usage"]["completion_tokens"] == 24
    assert "".join(streamed(server, body)[0]) == first["choices"][0]["text"]
    assert whole(server, {**body, "seed": 8})["choices"] != first["choices"]


def test_chat_streams_the_plain_answer(server):
    client = openai_client(server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    args = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    plain = client.chat.completions.create(**args, extra_body={"speculative": "off"})
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"draft_tokens": 3}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == plain.choices[0].message.content
    assert deltas[-1].finish_reason == plain.choices[0].finish_reason
    assert chunks[-1].usage == plain.usage


BAD_FIELDS = [  # (what, fields, param, words of the message)
    ("an unknown method", {"speculative": "eagle"}, "speculative", "'ngram', 'draft' or 'off'"),
    ("a method that is not a string", {"speculative": True}, "speculative", "'ngram', 'draft' or 'off'"),
    ("draft_tokens 0", {"draft_tokens": 0}, "draft_tokens", "from 1 to 15, got 0"),
    ("draft_tokens 16", {"speculative": "ngram", "draft_tokens": 16}, "draft_tokens", "from 1 to 15, got 16"),
    ("draft_tokens as text", {"draft_tokens": "4"}, "draft_tokens", "valid integer"),
    ("draft_tokens as a float", {"draft_tokens": 4.0}, "draft_tokens", "valid integer"),
    ("draft_tokens true", {"draft_tokens": True}, "draft_tokens", "valid integer"),
    ("adaptive_draft as text", {"adaptive_draft": "yes"}, "adaptive_draft", "valid boolean"),
    ("draft_tokens with speculation off", {"speculative": "off", "draft_tokens": 3}, "draft_tokens",
     "needs speculative decoding"),
    ("adaptive_draft with speculation off", {"speculative": "off", "adaptive_draft": True}, "adaptive_draft",
     "needs speculative decoding"),
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("what, fields, param, words", BAD_FIELDS, ids=[b[0] for b in BAD_FIELDS])
def test_bad_speculative_fields_are_a_400_naming_the_field(server, path, what, fields, param, words):
    prompt = {"prompt": [1]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    before = server.metrics()
    status, headers, raw = server.request("POST", path, {"model": MODEL, "max_tokens": 3, **prompt, **fields})
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"] and "Traceback" not in error["message"]
    after = server.metrics()
    assert after['cullama_requests_total{outcome="invalid"}'] - before['cullama_requests_total{outcome="invalid"}'] == 1
    assert after[GENERATED] == before[GENERATED]  # refused before it could queue


def test_a_client_leaving_a_burst_stream_cancels_it(server):
    # 400 tokens are seconds on this CPU; the client leaves after its first chunks. Not cancelled, it would
    # end "completed" with 400 tokens.
    before = server.metrics()
    body = json.dumps({"model": MODEL, "prompt": [1], "max_tokens": 400, "temperature": 0, "stream": True}).encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while b"data: " not in received:  # its first chunk came: it runs
            received += sock.recv(65536)
    cancelled = 'cullama_requests_total{outcome="cancelled"}'
    after = server.wait_metric(cancelled, lambda v: v == before[cancelled] + 1)
    assert after[GENERATED] - before[GENERATED] < 100
    server.wait_metric("cullama_generation_running", lambda v: v == 0)
    assert whole(server, {"prompt": [1], "max_tokens": 4})["choices"][0]["text"] == "Once upon a time"


# -- the command line: the speculative flags of `cullama serve` are `cullama generate`'s ----------------------
WRONG_FLAGS = [
    ("--speculative", "draft"),
    ("--draft-tokens", "3"),
    ("--adaptive-draft",),
    ("--speculative", "ngram", "--draft-tokens", "0"),
    ("--speculative", "ngram", "--draft-tokens", "16"),
    ("--speculative", "ngram", "--draft-model", "STORIES"),
    ("--speculative", "eagle"),
]


@pytest.mark.parametrize("flags", WRONG_FLAGS, ids=" ".join)
def test_wrong_speculative_flags_fail_serve_as_they_fail_generate(stories_dir, monkeypatch, flags):
    from cullama.cli.main import main

    def no_server(*args, **kwargs):
        raise AssertionError("the server was started despite the wrong flags")

    monkeypatch.setattr("cullama.server.launch.serve", no_server)
    flags = [str(stories_dir) if f == "STORIES" else f for f in flags]
    common = ["--model", str(stories_dir), "--device", "cpu", *flags]
    serve = CliRunner().invoke(main, ["serve", *common])
    generate = CliRunner().invoke(main, ["generate", *common, "x"])
    assert serve.exit_code == generate.exit_code == 2, serve.output
    assert serve.stderr.splitlines()[-1] == generate.stderr.splitlines()[-1]
    assert serve.stderr.splitlines()[-1].lower().startswith("error: ") and "Traceback" not in serve.stderr


def test_a_draft_model_that_cannot_draft_fails_before_listening(stories_dir, tmp_path):
    other, _, _ = load_golden("tiny-gqa-sharded")  # 1024 tokens; stories260K has 512
    for draft, words in ((other, "its vocabulary has 1024 tokens and the target's 512"),
                         (tmp_path / "nothing", "nothing")):
        done = run_serve("--model", str(stories_dir), "--device", "cpu", "--port", "0", "--draft-model", str(draft))
        assert done.returncode == 2 and done.stderr.startswith("error: ") and words in done.stderr, done.stderr
        assert "listening" not in done.stderr and "Traceback" not in done.stderr
