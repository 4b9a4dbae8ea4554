"""Which value wins when a request and the server both have one: `max_completion_tokens` over `max_tokens`, a
request's explicit `false` or `0` over a server-wide default of `true` or non-zero (`cullama serve
--speculative ngram --draft-tokens 6 --adaptive-draft`), and over the API's own defaults (temperature 1), and
null as "not given". Checked where it matters: the keyword arguments the engine hands Llama.stream (recorded
on the way through), and the tokens the answer counts. The app runs in this process on stories260K."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")
httpx = pytest.importorskip("httpx", reason="httpx comes with the test extra (pip install -e '.[test]')")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e '.[test]')")

from click.testing import CliRunner  # noqa: E402

from cullama.cli.main import main  # noqa: E402
from cullama.server.app import Settings, create_app  # noqa: E402
from cullama.server.engine import Engine  # noqa: E402
from cullama.server.launch import listen  # noqa: E402
from cullama.server.metrics import Metrics  # noqa: E402

SERVER_DEFAULT = {"speculative": "ngram", "draft_tokens": 6, "adaptive_draft": True}  # as `cullama serve` makes it
CHAT = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def llm(stories_dir):
    import cullama

    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


@pytest.fixture(scope="module")
def calls(llm):
    """The keyword arguments of every Llama.stream call the engine makes, in order."""
    made, real = [], llm.stream

    def stream(prompt, **options):
        made.append(options)
        return real(prompt, **options)

    llm.stream = stream
    yield made
    del llm.stream


@contextlib.contextmanager
def serving(llm, speculative: dict):
    """The app with these server-wide speculative defaults, on a real socket, uvicorn on a thread."""
    engine = Engine(lambda: llm, 8, Metrics())
    engine.start()
    sock = listen("127.0.0.1", 0)
    app = create_app(engine, Settings(model_name="m", context=llm.runner.max_seq_len, speculative=speculative),
                     engine.metrics)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started or engine.state == "loading":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        with httpx.Client(base_url="http://%s:%d" % sock.getsockname()[:2], timeout=120) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop()


@pytest.fixture(scope="module")
def plain(llm, calls):
    with serving(llm, {}) as client:
        yield client


@pytest.fixture(scope="module")
def drafting(llm, calls):
    with serving(llm, SERVER_DEFAULT) as client:
        yield client


def options_of(client, calls, path: str, body: dict) -> dict:
    """The keyword arguments Llama.stream got for one request (which must succeed)."""
    before = len(calls)
    answer = client.post(path, json=body)
    assert answer.status_code == 200, answer.text
    assert len(calls) == before + 1
    return calls[-1] | {"completion_tokens": answer.json()["usage"]["completion_tokens"]}


def refused(client, path: str, body: dict) -> dict:
    answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    return answer.json()["error"]


# ---- max_completion_tokens over max_tokens --------------------------------------------------------------------
@pytest.mark.parametrize("fields, limit", [
    ({"max_completion_tokens": 3, "max_tokens": 7}, 3),
    ({"max_tokens": 7, "max_completion_tokens": 3}, 3),  # the order in the body does not matter
    ({"max_completion_tokens": 7, "max_tokens": 3}, 7),
    ({"max_completion_tokens": None, "max_tokens": 3}, 3),  # null: not given
    ({"max_tokens": 3}, 3),
    ({"max_completion_tokens": 3}, 3),
])
def test_max_completion_tokens_wins_over_max_tokens(plain, calls, fields, limit):
    got = options_of(plain, calls, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True, **fields})
    assert got["max_new_tokens"] == got["completion_tokens"] == limit


def test_the_field_that_does_not_fit_is_the_one_named(plain, llm):
    context = llm.runner.max_seq_len
    error = refused(plain, "/v1/chat/completions",
                    {"messages": CHAT, "max_tokens": 2, "max_completion_tokens": context})
    assert error["param"] == "max_completion_tokens" and error["code"] == "context_length_exceeded"
    # max_tokens too large, max_completion_tokens small: it wins, and the request fits
    error = plain.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": context,
                                                       "max_completion_tokens": 2})
    assert error.status_code == 200 and error.json()["usage"]["completion_tokens"] <= 2


def test_a_zero_token_limit_is_refused_not_taken_for_no_limit(plain):
    for path, body in (("/v1/completions", {"prompt": [1]}), ("/v1/chat/completions", {"messages": CHAT})):
        for field in ("max_tokens", "max_completion_tokens") if "messages" in body else ("max_tokens",):
            error = refused(plain, path, {**body, field: 0})
            assert error["param"] == field, error


# ---- a request's false and 0 over the server's defaults ----------------------------------------------------------
def speculation(options: dict) -> tuple:
    return tuple(options.get(k) for k in ("speculative", "draft_tokens", "adaptive_draft"))


@pytest.mark.parametrize("fields, expected", [
    ({}, ("ngram", 6, True)),  # the server's defaults
    ({"speculative": None, "draft_tokens": None, "adaptive_draft": None}, ("ngram", 6, True)),  # null: not given
    ({"adaptive_draft": False}, ("ngram", 6, False)),  # false over the server's true
    ({"draft_tokens": 2}, ("ngram", 2, True)),
    ({"draft_tokens": 1, "adaptive_draft": False}, ("ngram", 1, False)),
    ({"speculative": "off"}, (None, None, None)),  # plain decoding: no speculative keyword at all
    ({"speculative": "off", "adaptive_draft": False}, (None, None, None)),
])
def test_a_request_overrides_the_servers_speculative_defaults(drafting, calls, fields, expected):
    got = options_of(drafting, calls, "/v1/completions", {"prompt": [1], "max_tokens": 4, "temperature": 0, **fields})
    assert speculation(got) == expected


@pytest.mark.parametrize("fields, param", [
    ({"draft_tokens": 0}, "draft_tokens"),  # 0 is refused, never replaced by the server's 6
    ({"draft_tokens": 16}, "draft_tokens"),
    ({"speculative": "off", "draft_tokens": 3}, "draft_tokens"),  # with plain decoding there is nothing to draft
    ({"speculative": "off", "adaptive_draft": True}, "adaptive_draft"),
])
def test_a_speculative_field_the_request_cannot_have_is_refused_whatever_the_server_default(drafting, fields, param):
    assert refused(drafting, "/v1/completions", {"prompt": [1], "max_tokens": 4, **fields})["param"] == param


def test_without_server_defaults_a_request_turns_speculation_on_with_the_librarys_defaults(plain, calls):
    got = options_of(plain, calls, "/v1/completions", {"prompt": [1], "max_tokens": 4, "speculative": "ngram"})
    assert speculation(got) == ("ngram", 4, False)
    assert speculation(options_of(plain, calls, "/v1/completions", {"prompt": [1], "max_tokens": 4})) == (None,) * 3


# ---- a request's 0 and false over the API's defaults ----------------------------------------------------------
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": [1]}),
                                        ("/v1/chat/completions", {"messages": CHAT})], ids=["completion", "chat"])
def test_zero_and_false_are_values_not_absences(plain, calls, path, body):
    given = options_of(plain, calls, path, {**body, "max_tokens": 3, "temperature": 0, "seed": 0, "top_k": 0,
                                            "ignore_eos": False, "stream": False})
    assert (given["temperature"], given["seed"], given["top_k"], given["ignore_eos"]) == (0, 0, 0, False)
    assert type(given["temperature"]) is float and type(given["seed"]) is int
    absent = options_of(plain, calls, path, {**body, "max_tokens": 3})
    assert (absent["temperature"], absent["seed"], absent["top_k"], absent["ignore_eos"]) == (1.0, None, 0, False)
    nulls = options_of(plain, calls, path, {**body, "max_tokens": 3, "temperature": None, "seed": None,
                                            "top_k": None, "top_p": None, "repetition_penalty": None})
    assert (nulls["temperature"], nulls["seed"], nulls["top_k"], nulls["top_p"], nulls["repetition_penalty"]) == \
        (1.0, None, 0, 1.0, 1.0)


def test_seed_0_repeats_itself_and_differs_from_an_unseeded_answer(plain, llm):
    body = {"prompt": [1], "max_tokens": 12, "temperature": 1.0, "seed": 0, "ignore_eos": True}
    texts = {plain.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2)}
    assert texts == {llm.generate([1], max_new_tokens=12, temperature=1.0, seed=0, ignore_eos=True).text}


# ---- the server's defaults, as `cullama serve` makes them ------------------------------------------------------
@pytest.mark.parametrize("flags, default", [
    ([], {}),
    (["--speculative", "ngram"], {"speculative": "ngram", "draft_tokens": 4, "adaptive_draft": False}),
    (["--speculative", "ngram", "--draft-tokens", "6", "--adaptive-draft"], SERVER_DEFAULT),
])
def test_serve_flags_become_every_requests_default(monkeypatch, tmp_path, flags, default):
    import cullama.server.launch as launch

    seen = {}
    monkeypatch.setattr(launch, "serve", lambda model_dir, **kwargs: seen.update(kwargs) or 0)
    result = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), *flags])
    assert result.exit_code == 0, result.output
    assert seen["speculative"] == default and seen["max_queue"] == 64
