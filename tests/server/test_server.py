"""`cullama serve` end to end: one real server process (stories260K on the CPU, 127.0.0.1, a free port)
shared by the module, driven with the official `openai` client and raw HTTP. The answers are checked
against the documented greedy text and against the library itself (`Llama.generate` in this process):
the server must answer exactly what a sequential run of the same request gives."""

from __future__ import annotations

import http.client
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.serving import stories_client, stories_oracle, stories_server  # noqa: F401  (fixtures)

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency (pip install -e '.[test]')")

MODEL = "stories260K"  # the served name defaults to the model directory's name
ONCE = [1, 403, 407, 261, 378]  # BOS "Once upon a time" as the model writes it (its tokenizer.model only decodes)
CANCELLED = 'cullama_requests_total{outcome="cancelled"}'
COMPLETED = 'cullama_requests_total{outcome="completed"}'
GENERATED = "cullama_generation_tokens_total"


def test_greedy_completion_from_bos_is_the_documented_text(client, stories_expected):
    n = len(stories_expected["ids"])
    out = client.completions.create(model=MODEL, prompt=[1], max_tokens=n, temperature=0)
    assert out.choices[0].text == stories_expected["text"]
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (1, n, n + 1)
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")


def test_streamed_chunks_concatenate_to_the_whole_answer(client):
    args = dict(model=MODEL, prompt=ONCE, max_tokens=24, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert len(choices) > 10  # streamed as it was generated, not in one piece
    assert "".join(c.text for c in choices) == whole.choices[0].text
    assert [c.finish_reason for c in choices][-1] == whole.choices[0].finish_reason == "length"
    assert all(c.finish_reason is None for c in choices[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # include_usage: the last chunk
    assert len({c.id for c in chunks}) == 1


@pytest.mark.parametrize("path, prompt", [("/v1/completions", {"prompt": [1]}),
                                          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})],
                         ids=["completions", "chat"])
def test_with_include_usage_every_chunk_says_usage_null_until_the_last(server, path, prompt):
    for include_usage in (True, False):
        chunks = server.sse(path, {**prompt, "max_tokens": 4, "temperature": 0,
                                   "stream_options": {"include_usage": include_usage}})
        if include_usage:  # as OpenAI's: the key in every chunk, null until the extra last one
            assert all(c["usage"] is None and c["choices"] for c in chunks[:-1]) and len(chunks) >= 3
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
        else:
            assert all("usage" not in c for c in chunks)


def test_a_stop_string_split_across_tokens_never_leaks_into_the_stream(server, oracle, stories_expected):
    stop = "le gi"  # " little" " g" "irl": it begins in one token and ends two tokens later
    pieces = [oracle.tokenizer.piece(i).replace("\u2581", " ") for i in stories_expected["ids"][:12]]
    assert stop in "".join(pieces) and not any(stop in p for p in pieces)
    body = {"model": MODEL, "prompt": [1], "max_tokens": 30, "temperature": 0, "stop": [stop]}
    chunks = server.sse("/v1/completions", body)
    pieces = [c["choices"][0]["text"] for c in chunks]
    assert "".join(pieces) == "Once upon a time, there was a litt"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    whole = json.loads(server.request("POST", "/v1/completions", body)[2])
    assert whole["choices"][0]["text"] == "".join(pieces) and whole["choices"][0]["finish_reason"] == "stop"


def test_chat_streams_and_finishes_through_the_llama2_template(client, oracle):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    expected = oracle.generate(oracle.chat_ids(messages), max_new_tokens=12)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    assert "".join(d.delta.content or "" for d in deltas) == expected.text
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert chunks[-1].usage.prompt_tokens == len(oracle.chat_ids(messages))
    assert chunks[-1].usage.completion_tokens == 12
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                           temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected.text
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")


def test_models_are_listed(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


# 16 requests of every kind: completions and chat, streamed or not, greedy or seeded sampling, stop strings.
SPECS = [
    {"chat": i % 4 == 3, "stream": i % 2 == 1, "max_tokens": 6 + i % 5,
     "temperature": 0.0 if i % 3 == 0 else 0.9, "seed": 100 + i, "top_k": (0, 40)[i % 2],
     "top_p": (1.0, 0.9)[i % 3 == 2],
     "stop": [" the"] if i % 5 == 4 else None,
     "prompt": [1, 403, 407, 261, 378, 432][: 1 + i % 6] if i % 4 != 1 else f"Story number {i}:"}
    for i in range(16)
]


def messages_of(spec) -> list[dict]:
    prompt = spec["prompt"] if isinstance(spec["prompt"], str) else f"A story of {len(spec['prompt'])} words."
    return [{"role": "user", "content": prompt}]


def ask(client, spec, disconnect_after: int | None = None) -> tuple[str, str | None]:
    """(text, finish_reason) of one request; with `disconnect_after`, close the stream after that many chunks."""
    args = {"model": MODEL, "max_tokens": spec["max_tokens"], "temperature": spec["temperature"],
            "seed": spec["seed"], "top_p": spec["top_p"], "stop": spec["stop"], "stream": spec["stream"],
            "extra_body": {"top_k": spec["top_k"]}}
    create = client.chat.completions.create if spec["chat"] else client.completions.create
    args.update({"messages": messages_of(spec)} if spec["chat"] else {"prompt": spec["prompt"]})
    out = create(**args)
    if not spec["stream"]:
        choice = out.choices[0]
        return (choice.message.content if spec["chat"] else choice.text), choice.finish_reason
    text, finish = [], None
    for i, chunk in enumerate(out):
        if disconnect_after is not None and i == disconnect_after:
            out.close()
            return "".join(text), None
        if chunk.choices:
            choice = chunk.choices[0]
            text.append((choice.delta.content or "") if spec["chat"] else choice.text)
            finish = choice.finish_reason or finish
    return "".join(text), finish


@pytest.fixture(scope="module")
def sequential(oracle) -> list:
    """The Generation of each spec, run alone by the library."""
    out = []
    for spec in SPECS:
        prompt = oracle.chat_ids(messages_of(spec)) if spec["chat"] else spec["prompt"]
        out.append(oracle.generate(prompt, max_new_tokens=spec["max_tokens"], temperature=spec["temperature"],
                                   seed=spec["seed"], top_k=spec["top_k"], top_p=spec["top_p"],
                                   stop=spec["stop"] or ()))
    return out


@pytest.fixture(scope="module")
def sequential_answers(sequential) -> list[tuple[str, str]]:
    return [(g.text, {"eos": "stop"}.get(g.finish_reason, g.finish_reason)) for g in sequential]


class QueueWatch:
    """The deepest queue /metrics showed while it ran: proof that the requests did wait for each other."""

    def __init__(self, server):
        self.server, self.deepest, self.done = server, 0, threading.Event()
        self.thread = threading.Thread(target=self.run)

    def run(self):
        while not self.done.is_set():
            self.deepest = max(self.deepest, self.server.metrics()["cullama_queue_depth"])
            self.done.wait(0.05)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()


def test_sixteen_concurrent_clients_each_get_their_sequential_answer(server, client, sequential_answers):
    before = server.metrics()
    with QueueWatch(server) as watch, ThreadPoolExecutor(len(SPECS)) as pool:
        answers = list(pool.map(lambda spec: ask(client, spec), SPECS))
    assert answers == sequential_answers
    assert watch.deepest >= 2
    after = server.metrics()
    assert after[COMPLETED] - before[COMPLETED] == len(SPECS)


def test_four_clients_leaving_mid_stream_leave_the_others_unharmed_and_the_engine_free(
        server, client, sequential, sequential_answers):
    # Each leaver asks for 400 tokens (seconds on this CPU) and leaves after 3 chunks; the twelve others
    # queue between them. A leaver not cancelled would end "completed", and late, with hundreds of tokens.
    leaver = {"chat": False, "stream": True, "max_tokens": 400, "temperature": 0.0, "seed": 1, "top_k": 0,
              "top_p": 1.0, "stop": None, "prompt": [1]}
    jobs = [(leaver, 3) if i % 4 == 0 else (SPECS[i], None) for i in range(16)]
    before = server.metrics()
    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda job: ask(client, *job), jobs))
    for (spec, leaves), answer, i in zip(jobs, answers, range(16)):
        if leaves is None:
            assert answer == sequential_answers[i]
        else:
            assert answer[1] is None and answer[0].startswith("Once")  # cut off, as it asked
    after = server.wait_metric(CANCELLED, lambda v: v >= before[CANCELLED] + 4)
    assert after[CANCELLED] - before[CANCELLED] == 4
    assert after[COMPLETED] - before[COMPLETED] == 12
    others = sum(len(g.token_ids) for (_, leaves), g in zip(jobs, sequential) if leaves is None)
    leavers = after[GENERATED] - before[GENERATED] - others
    assert 4 * 3 <= leavers < 4 * 100  # of 4 * 400: each stopped soon after its client left
    after = server.wait_metric("cullama_generation_running", lambda v: v == 0)
    assert after["cullama_queue_depth"] == 0
    assert ask(client, SPECS[0]) == sequential_answers[0]


def test_a_client_leaving_a_non_streamed_request_cancels_it(server):
    before = server.metrics()
    body = json.dumps({"model": MODEL, "prompt": [1], "max_tokens": 400, "temperature": 0}).encode()
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        server.wait_metric("cullama_generation_running", lambda v: v == 1)
    after = server.wait_metric(CANCELLED, lambda v: v == before[CANCELLED] + 1)
    assert after[COMPLETED] == before[COMPLETED]
    assert after[GENERATED] - before[GENERATED] < 100  # of 400: it stopped soon after its client left
    server.wait_metric("cullama_generation_running", lambda v: v == 0)


BAD_REQUESTS = [  # (what, path, body, status, param)
    ("malformed JSON", "/v1/completions", b'{"prompt": [1', 400, None),
    ("an empty body", "/v1/completions", b"", 400, None),
    ("a JSON array", "/v1/completions", b"[1, 2]", 400, None),
    ("a wrong type", "/v1/completions", {"prompt": [1], "max_tokens": "ten"}, 400, "max_tokens"),
    ("a negative max_tokens", "/v1/completions", {"prompt": [1], "max_tokens": -5}, 400, "max_tokens"),
    ("n=0", "/v1/completions", {"prompt": [1], "n": 0}, 400, "n"),
    ("n past what the server holds", "/v1/completions", {"prompt": [1], "n": 73}, 400, "n"),  # 8 running, 64 waiting
    ("logprobs past 5", "/v1/completions", {"prompt": [1], "logprobs": 6}, 400, "logprobs"),
    ("a tool without its function", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("tools on /v1/completions", "/v1/completions", {"prompt": [1], "tools": [{"type": "function"}]}, 400, "tools"),
    ("a batch of texts and ids", "/v1/completions", {"prompt": ["a", [1]]}, 400, "prompt"),
    ("a batch with an empty id list", "/v1/completions", {"prompt": [[1], []]}, 400, "prompt.1"),
    ("a batch with a prompt over the context", "/v1/completions", {"prompt": [[1], [1] * 600]}, 400, "prompt.1"),
    ("a token id outside the vocabulary", "/v1/completions", {"prompt": [1, 512]}, 400, "prompt"),
    ("an out-of-range top_p", "/v1/completions", {"prompt": [1], "top_p": 1.5}, 400, "top_p"),
    ("a negative top_p", "/v1/completions", {"prompt": [1], "top_p": -0.1}, 400, "top_p"),
    ("a seed below int64's", "/v1/completions", {"prompt": [1], "seed": -2**63 - 1}, 400, "seed"),
    ("an assistant turn first", "/v1/chat/completions", {"messages": [{"role": "assistant", "content": "x"}]},
     400, "messages"),
    ("no prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("an unknown model", "/v1/completions", {"prompt": [1], "model": "gpt-4"}, 404, "model"),
    ("a prompt over the context", "/v1/completions", {"prompt": [1] * 600}, 400, "prompt"),
    ("max_tokens past the context", "/v1/completions", {"prompt": [1], "max_tokens": 600}, 400, "max_tokens"),
    ("max_tokens past the rest of the context", "/v1/completions", {"prompt": [1] * 500, "max_tokens": 13}, 400,
     "max_tokens"),
    ("a huge max_tokens", "/v1/completions", {"prompt": [1], "max_tokens": 10**23}, 400, "max_tokens"),
    ("max_completion_tokens past the context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 512}, 400, "max_completion_tokens"),
    ("a stop of the wrong type", "/v1/completions", {"prompt": [1], "stop": 5}, 400, "stop"),
    ("a stop list holding a number", "/v1/completions", {"prompt": [1], "stop": ["a", 1]}, 400, "stop"),
    ("17 stop strings", "/v1/completions", {"prompt": [1], "stop": [str(i) for i in range(17)]}, 400, "stop"),
    ("a prompt of the wrong type", "/v1/completions", {"prompt": 1}, 400, "prompt"),
    ("a message content of the wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     400, "messages.0.content"),
    ("an unknown route", "/v1/embeddings", {"input": "x"}, 404, None),
    ("a lone surrogate", "/v1/completions", rb'{"prompt": "\ud800 hi"}', 400, "prompt"),
    ("a developer message second", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "developer", "content": "be brief"}]}, 400, "messages.1.role"),
    ("an assistant turn that called tools", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "content": "4", "tool_call_id": "c1"}]}, 400, "messages"),  # LLaMA-2's format has none
]


@pytest.mark.parametrize("what, path, body, status, param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_a_bad_request_gets_its_4xx_as_an_openai_error(server, what, path, body, status, param):
    got, headers, raw = server.request("POST", path, body)
    assert got == status, raw
    assert headers["content-type"] == "application/json"
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    if what == "a prompt over the context" or "tokens past" in what:
        assert error["code"] == "context_length_exceeded" and "512" in error["message"]
    if what == "17 stop strings":
        assert error["message"] == "stop: at most 16 stop strings are allowed, got 17"
    elif param in ("stop", "messages.0.content") or what == "a prompt of the wrong type":  # unions of types
        assert error["message"].startswith(f"{param} must be ") and ".str" not in error["message"]


def test_after_bad_requests_a_wrong_method_is_405_and_a_normal_request_still_works(server, client):
    status, _, raw = server.request("GET", "/v1/completions")
    assert status == 405 and json.loads(raw)["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="n must be at least 1"):
        client.completions.create(model=MODEL, prompt=[1], n=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt=[1])
    out = client.completions.create(model=MODEL, prompt=[1], max_tokens=4, temperature=0)
    assert out.choices[0].text == "Once upon a time"


def test_a_request_may_turn_speculation_on_but_draft_needs_a_draft_model(server, client):
    # This server decodes plainly by default and has no draft model (tests/server/test_server_speculative.py has one).
    args = dict(model=MODEL, prompt=ONCE, max_tokens=20, temperature=0)
    plain = client.completions.create(**args)
    before = server.metrics()
    spec = client.completions.create(**args, extra_body={"speculative": "ngram", "draft_tokens": 3})
    after = server.metrics()
    assert spec.choices == plain.choices and spec.usage == plain.usage
    steps, accepted = (after[name] - before[name] for name in (
        'cullama_speculative_steps_total{method="ngram"}', 'cullama_speculative_accepted_tokens_total{method="ngram"}'))
    assert steps + accepted == 19  # each step: its accepted drafts and a token of its own
    with pytest.raises(openai.BadRequestError, match="needs a draft model") as refused:
        client.completions.create(**args, extra_body={"speculative": "draft"})
    assert refused.value.body["param"] == "speculative"


def test_null_fields_mean_their_defaults_as_in_openais_api(server):
    nulls = dict.fromkeys(("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop",
                           "stream", "stream_options", "n", "user", "ignore_eos", "logprobs", "model",
                           "speculative", "draft_tokens", "adaptive_draft"))
    status, _, raw = server.request("POST", "/v1/completions", {**nulls, "prompt": [1]})
    assert status == 200
    assert json.loads(raw)["usage"]["completion_tokens"] == 16  # OpenAI's default max_tokens for completions
    chat = {**nulls, "max_completion_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    status, _, raw = server.request("POST", "/v1/chat/completions", chat)
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] <= 3


def test_metrics_parse_as_prometheus_text_and_move_with_the_requests(server, client):
    status, headers, _ = server.request("GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
    before = server.metrics()  # parse_prometheus checks the format as it reads
    out = client.completions.create(model=MODEL, prompt=ONCE, max_tokens=7, temperature=0)
    assert server.request("POST", "/v1/completions", {"prompt": [1], "n": 0})[0] == 400
    after = server.metrics()

    def moved(name):
        return after[name] - before[name]

    assert moved(COMPLETED) == 1 and moved('cullama_requests_total{outcome="invalid"}') == 1
    assert moved("cullama_prompt_tokens_total") == len(ONCE) == out.usage.prompt_tokens
    assert moved("cullama_generation_tokens_total") == 7 == out.usage.completion_tokens
    assert moved("cullama_time_to_first_token_seconds_count") == 1
    assert moved("cullama_time_between_tokens_seconds_count") == 6  # between 7 tokens
    assert moved("cullama_time_between_tokens_seconds_sum") > 0
    assert after["cullama_queue_depth"] == 0 and after["cullama_generation_running"] == 0


def test_a_max_tokens_that_fills_the_context_exactly_is_served_and_without_one_the_context_is_the_limit(server):
    status, _, raw = server.request("POST", "/v1/completions", {"prompt": [1] * 500, "max_tokens": 12,
                                                                "temperature": 0, "ignore_eos": True})
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 12
    # No max_tokens (OpenAI's default for completions is 16): the generation stops at the context's end.
    status, _, raw = server.request("POST", "/v1/completions", {"prompt": [1] * 508, "temperature": 0,
                                                                "ignore_eos": True})
    choice, usage = json.loads(raw)["choices"][0], json.loads(raw)["usage"]
    assert status == 200 and choice["finish_reason"] == "length" and usage["completion_tokens"] == 4
    refused = json.loads(server.request("POST", "/v1/completions", {"prompt": [1] * 500, "max_tokens": 13})[2])
    assert refused["error"]["message"] == ("this model's maximum context length is 512 tokens; the prompt has 500 "
                                           "and max_tokens asks for 13 more: ask for at most 12")


def test_unknown_fields_and_a_user_are_ignored(server):
    body = {"prompt": [1], "max_tokens": 4, "temperature": 0, "user": "user-1234", "metadata": {"team": "a"},
            "foo": [1, 2], "x-cullama-never-heard-of-it": None}
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "Once upon a time"
    chat = {"messages": [{"role": "user", "content": "hi", "name": "bob"}], "max_tokens": 2, "user": "u", "foo": 1}
    assert server.request("POST", "/v1/chat/completions", chat)[0] == 200


def refused(server, status, code, method="POST", path="/v1/completions", body=b'{"prompt": [1], "max_tokens": 2}',
            **headers):
    got, answer_headers, raw = server.request(method, path, body, headers)
    assert got == status, raw
    assert answer_headers["content-type"] == "application/json" and json.loads(raw)["error"]["code"] == code
    return json.loads(raw)["error"]["message"]


def test_a_web_page_cannot_drive_the_loopback_server(server):
    # A page can send text/plain (or a form) anywhere without asking the browser first: such bodies are refused.
    before = server.metrics()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "", "application/jsonp"):
        message = refused(server, 415, "unsupported_media_type", **{"Content-Type": content_type})
        assert "Content-Type: application/json" in message
    # DNS rebinding: a page on a name the attacker points at 127.0.0.1 names it in every request.
    message = refused(server, 400, "invalid_host", Host="rebind.evil.example:%d" % server.port)
    assert "`rebind.evil.example`" in message and "--allowed-hosts rebind.evil.example" in message
    assert refused(server, 400, "invalid_host", "GET", "/metrics", None, Host="evil.example")
    # A page of another origin: refused, its preflight too (no CORS headers are given to anyone by default).
    message = refused(server, 403, "origin_not_allowed", Origin="http://evil.example")
    assert "--allowed-origins http://evil.example" in message
    refused(server, 403, "origin_not_allowed", "OPTIONS", body=None, Origin="http://evil.example",
            **{"Access-Control-Request-Method": "POST"})
    refused(server, 403, "origin_not_allowed", "GET", "/health", None, Origin="null")
    after = server.metrics()
    assert after['cullama_requests_total{outcome="invalid"}'] - before['cullama_requests_total{outcome="invalid"}'] \
        == 7 and after[COMPLETED] == before[COMPLETED]
    # What a program or the server's own origin sends is served.
    ok = {"prompt": [1], "max_tokens": 2, "temperature": 0}
    for headers in ({"Host": f"localhost:{server.port}"}, {"Host": f"[::1]:{server.port}"},
                    {"Content-Type": "Application/JSON; charset=utf-8"},
                    {"Origin": f"http://127.0.0.1:{server.port}"}):
        status, _, raw = server.request("POST", "/v1/completions", ok, headers)
        assert status == 200 and json.loads(raw)["choices"][0]["text"] == "Once upon", headers


def test_malformed_http_is_answered_with_an_openai_error(server):
    for request in (b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without a Host
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
                    b"GET /he\x00alth HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"):
        with socket.create_connection((server.host, server.port), timeout=30) as sock:
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(65536):  # the server closes the connection after it
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head.lower(), answer
        assert json.loads(body)["error"]["code"] == "malformed_http"


def test_head_health_answers_as_get_does(server):
    status, _, raw = server.request("HEAD", "/health")
    assert status == 200 and raw == b""


def test_a_body_past_the_limit_is_a_413_whether_its_length_is_told_or_not(server):
    from cullama.server.app import body_limit

    limit = body_limit(512)
    body = json.dumps({"prompt": "x" * limit}).encode()
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 413, raw
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert f"{limit} bytes" in error["message"]
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)  # chunked: no Content-Length
    try:
        conn.request("POST", "/v1/completions", body=iter([body[i:i + 65536] for i in range(0, len(body), 65536)]),
                     headers={"Content-Type": "application/json"}, encode_chunked=True)
        response = conn.getresponse()
        assert response.status == 413 and json.loads(response.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()
    fits = json.dumps({"prompt": [1], "max_tokens": 4, "temperature": 0, "user": "x" * (limit - 100)})
    assert len(fits) <= limit and server.request("POST", "/v1/completions", fits)[0] == 200


def test_what_openai_takes_for_top_p_and_seed_is_served(client, oracle):
    """The fourth sweep: top_p 0 (OpenAI's range is [0, 1]: the most likely token alone) and a negative seed (an
    int64: front-ends send -1) were 400s. top_p 0 now samples the top token alone, which is greedy's; a negative
    seed is the library's seed of the same 64 bits, as reproducible as any."""
    sampled = dict(model=MODEL, prompt=ONCE, max_tokens=16, temperature=1.0)
    greedy = oracle.generate(ONCE, max_new_tokens=16).text
    assert client.completions.create(**sampled, top_p=0, seed=5).choices[0].text == greedy
    minus_one = client.completions.create(**sampled, seed=-1).choices[0].text
    assert minus_one == client.completions.create(**sampled, seed=-1).choices[0].text
    assert minus_one == oracle.generate(ONCE, max_new_tokens=16, temperature=1.0, seed=2**64 - 1).text

