"""The prefix cache behind the API: a request whose prompt begins like an earlier one skips the whole prefill chunks
they share, says so in usage.prompt_tokens_details.cached_tokens (OpenAI's field) and in /metrics, and answers what
the library answers on a fresh model, whether the server runs one generation at a time (--max-batch 1) or a batch."""

from __future__ import annotations

import pytest

from tests.serving import openai_client, running

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")
pytest.importorskip("openai", reason="the openai client is a test dependency (pip install -e '.[test]')")

MODEL = "stories260K"
CACHED = "cullama_prompt_tokens_cached_total"
HISTORY = [1] + [3 + (7 * i) % 500 for i in range(150)]  # 151 ids


@pytest.fixture(scope="module", params=["1", "3"], ids=["max-batch-1", "max-batch-3"])
def server(request, stories_dir, tmp_path_factory):
    """stories260K served with 16-row prefill chunks (so that 151 ids hold 9 whole chunks)."""
    with running(stories_dir, tmp_path_factory.mktemp("serve"), "--max-batch", request.param,
                 "--prefill-chunk", "16") as proc:
        yield proc


@pytest.fixture(scope="module")
def fresh(stories_dir):
    """The library with the prefix cache off: every prompt from row 0."""
    import cullama

    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", prefill_chunk=16)
    llm.runner.prefix_cache = False
    return llm


def test_a_prompt_that_begins_like_the_last_skips_their_whole_chunks(server, fresh):
    client = openai_client(server)
    before = server.metrics()[CACHED]
    options = dict(model=MODEL, max_tokens=12, temperature=0.9, top_p=0.95, seed=3)
    first = client.completions.create(prompt=HISTORY, **options)
    follow = HISTORY[:140] + [9, 10, 11]
    again = client.completions.create(prompt=follow, **options)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 128  # 8 whole chunks of 16 in the 140 shared ids
    assert again.usage.prompt_tokens == len(follow)
    expected = fresh.generate(follow, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=3)
    assert again.choices[0].text == expected.text
    streamed = list(client.completions.create(prompt=follow, **options, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected.text
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == 128
    assert server.metrics()[CACHED] == before + 256


def test_n_choices_count_their_prompt_once(server):
    client = openai_client(server)
    client.completions.create(model=MODEL, prompt=HISTORY, max_tokens=2, temperature=0)
    out = client.completions.create(model=MODEL, prompt=HISTORY[:100], max_tokens=3, temperature=0.8, seed=1, n=2)
    assert out.usage.prompt_tokens == 100
    assert out.usage.prompt_tokens_details.cached_tokens == 96  # the first choice's (each row counts its own)


def test_a_short_prompt_reports_none():
    from cullama.server.responses import usage

    assert usage(5, 3) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                           "prompt_tokens_details": {"cached_tokens": 0}}
