"""`n` > 1 and lists of prompts (server/choices.py) end to end, through the official `openai` client and raw SSE
(stories260K on the CPU, a real server process): each choice is the request alone with its prompt and its seed (seed
+ j), at index i * n + j, whole and streamed, with its own log-probabilities and echo; `usage` adds up; what a server
can never hold is a 400 naming the field; and lm-evaluation-harness's batched log-likelihood request (--batch_size 4:
a list of token-id lists with echo, logprobs 1, max_tokens 1 or 0) replayed without lm-eval."""

from __future__ import annotations

import json
from operator import itemgetter

import pytest

from tests.serving import running, stories_client, stories_oracle, stories_server  # noqa: F401  (fixtures)

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency (pip install -e '.[test]')")

from cullama.server.choices import seeds  # noqa: E402  (the serve extra)

MODEL = "stories260K"
STORY = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 13, 438]
SAMPLED = dict(temperature=1.0, top_p=0.95, max_tokens=12)


def same(choice, alone) -> bool:
    """A choice of a request of several equals the one choice of the request alone, but for its index."""
    return (choice.text, choice.finish_reason, choice.logprobs) == (alone.text, alone.finish_reason, alone.logprobs)


def test_n_choices_are_the_request_alone_with_seed_plus_j(client, oracle):
    out = client.completions.create(model=MODEL, prompt=STORY[:3], n=3, seed=41, logprobs=2, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = [client.completions.create(model=MODEL, prompt=STORY[:3], seed=41 + j, logprobs=2, **SAMPLED)
             for j in range(3)]
    assert all(same(c, a.choices[0]) for c, a in zip(out.choices, alone))
    assert out.choices[0].text == oracle.generate(STORY[:3], max_new_tokens=12, temperature=1.0, top_p=0.95,
                                                  seed=41).text
    assert len({c.text for c in out.choices}) > 1  # three seeds, three draws (these three differ)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == \
        (3, sum(a.usage.completion_tokens for a in alone))


def test_the_seeds_of_the_choices():
    assert seeds(41, 3) == [41, 42, 43] and seeds(None, 2) == [None, None]
    assert seeds(2**64 - 1, 2) == [2**64 - 1, 0]  # the library's seeds are [0, 2**64)


def test_without_a_seed_each_choice_draws_its_own(client):
    out = client.completions.create(model=MODEL, prompt=[1], n=4, temperature=1.5, max_tokens=16)
    assert len({c.text for c in out.choices}) > 1


def test_a_list_of_prompts_each_with_n_choices_at_i_times_n_plus_j(client):
    prompts = [STORY[:3], [1], STORY[:8]]
    args = dict(model=MODEL, seed=7, echo=True, logprobs=1, **SAMPLED)
    out = client.completions.create(prompt=prompts, n=2, **args)
    assert [c.index for c in out.choices] == list(range(6))
    alone = {(i, j): client.completions.create(prompt=p, **{**args, "seed": 7 + j})
             for i, p in enumerate(prompts) for j in range(2)}
    for (i, j), answer in alone.items():
        assert same(out.choices[i * 2 + j], answer.choices[0]), (i, j)
    assert out.usage.prompt_tokens == sum(map(len, prompts))  # each prompt once, however many choices it has
    assert out.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone.values())
    # the echo: each choice's text starts with its own prompt's
    assert out.choices[4].text.startswith("Once upon a time, there was") and out.choices[0].text.startswith("Once upon")


def test_a_list_of_texts(client, oracle):
    texts = ["Once upon a time", "The cat sat", ""]
    out = client.completions.create(model=MODEL, prompt=texts, max_tokens=6, temperature=0)
    for choice, text in zip(out.choices, texts):
        assert choice.text == oracle.generate(text, max_new_tokens=6).text
    assert out.choices[2].text == "Once upon a time, there"  # "" is BOS alone


def chunks_by_choice(chunks: list[dict]) -> dict[int, list[dict]]:
    by: dict[int, list[dict]] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]  # one choice a chunk, as OpenAI streams them
        by.setdefault(choice["index"], []).append(choice)
    return by


def test_streamed_choices_add_up_to_the_whole(server):
    body = {"model": MODEL, "prompt": [STORY[:3], STORY[:6]], "n": 2, "seed": 3, "echo": True, "logprobs": 2,
            "stop": [" big"], **SAMPLED}
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200
    whole = json.loads(raw)
    chunks = server.sse("/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    by = chunks_by_choice(chunks[:-1])
    assert sorted(by) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        streamed = by[choice["index"]]
        assert "".join(c["text"] for c in streamed) == choice["text"]
        assert [c["finish_reason"] for c in streamed] == [None] * (len(streamed) - 1) + [choice["finish_reason"]]
        merged = {key: [] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        for c in streamed:
            for key in merged:
                merged[key] += c["logprobs"][key] if c["logprobs"] else []
        assert merged == choice["logprobs"]
        assert streamed[0]["logprobs"]["token_logprobs"][0] is None  # each choice's echo comes with its first chunk


def test_chat_n_choices_whole_and_streamed(client):
    messages = [{"role": "user", "content": "Tell me a story."}]
    args = dict(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, logprobs=True, top_logprobs=2)
    out = client.chat.completions.create(n=3, seed=5, **args)
    for j, choice in enumerate(out.choices):
        alone = client.chat.completions.create(seed=5 + j, **args).choices[0]
        assert choice.index == j and choice.message.content == alone.message.content
        assert choice.logprobs == alone.logprobs and choice.finish_reason == alone.finish_reason
    streamed = list(client.chat.completions.create(n=3, seed=5, stream=True, **args))
    texts, roles = {}, {}
    for chunk in streamed:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        roles.setdefault(choice.index, choice.delta.role)  # each choice's first chunk names the role
    assert texts == {c.index: c.message.content for c in out.choices}
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}


def test_what_the_server_can_never_hold_is_a_400_naming_the_field(stories_dir, tmp_path):
    # --max-batch 2 running and --max-queue 1 waiting: three rows at most
    with running(stories_dir, tmp_path, "--max-batch", "2", "--max-queue", "1") as small:
        client = openai.OpenAI(base_url=f"{small.url}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model=MODEL, prompt=[1], n=3, max_tokens=2, temperature=0)
        assert len(out.choices) == 3
        with pytest.raises(openai.BadRequestError, match="n = 4 asks for 4 choices, each a generation of its own, and "
                                                         "this server holds at most 3 at once") as refused:
            client.completions.create(model=MODEL, prompt=[1], n=4, max_tokens=2)
        assert refused.value.body["param"] == "n"
        with pytest.raises(openai.BadRequestError, match="2 prompts x n = 2 asks for 4 choices") as refused:
            client.completions.create(model=MODEL, prompt=[[1], [1, 403]], n=2, max_tokens=2)
        assert refused.value.body["param"] == "prompt"


def test_usage_counts_the_ending_eos_as_the_logprobs_do(stories_dir, tmp_path):
    """A generation that ends with an EOS produced it: usage.completion_tokens counts it, as many as the logprob
    entries (a copy of stories260K whose generation_config.json also ends on " time", its fourth greedy token)."""
    model = tmp_path / "stories260K"
    model.mkdir()
    for file in stories_dir.iterdir():
        (model / file.name).symlink_to(file)
    (model / "generation_config.json").unlink()
    (model / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 378]}))
    with running(model, tmp_path) as ending:
        client = openai.OpenAI(base_url=f"{ending.url}/v1", api_key="x", max_retries=0)
        out = client.completions.create(model=MODEL, prompt=[1], max_tokens=10, temperature=0, logprobs=0, n=2)
        for choice in out.choices:
            assert (choice.text, choice.finish_reason) == ("Once upon a", "stop")
            assert choice.logprobs.tokens == [" Once", " upon", " a", " time"]  # the EOS has its entry
        assert out.usage.completion_tokens == 2 * 4 and out.usage.prompt_tokens == 1
        chunks = list(client.completions.create(model=MODEL, prompt=[1], max_tokens=10, temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 4


# -- lm-evaluation-harness ------------------------------------------------------------------------------------

def lm_eval_parse_logprobs(outputs: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval 0.4.13's LocalCompletionsAPI.parse_logprobs, as it reads a batched answer: the choices sorted by index,
    each prompt's continuation the tokens after its context, the last entry the one token generated (max_tokens 1)."""
    res = []
    for choice, ctxlen in zip(sorted(outputs["choices"], key=itemgetter("index")), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        res.append((sum(token_logprobs), all(lp == max(top.values()) for lp, top in zip(token_logprobs, tops))))
    return res


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_evaluation_harness_batched_loglikelihood_request(server, oracle, max_tokens):
    """What `lm_eval --model local-completions --batch_size 4` sends for four log-likelihood requests (its
    _create_payload, generate=False: the batch's context + continuation ids, longest first), and reads back.
    max_tokens 1 is 0.4.13's; 0 its older versions' (whose reading drops the last prompt token instead)."""
    requests = [(STORY[:10], STORY[10:18]), (STORY[:6], STORY[6:9]), (STORY[:4], STORY[4:6]), (STORY[:2], [13])]
    body = {"model": MODEL, "prompt": [c + k for c, k in requests], "temperature": 0, "max_tokens": max_tokens,
            "logprobs": 1, "seed": 1234, "echo": True}
    status, _, raw = server.request("POST", "/v1/completions", body)
    assert status == 200, raw
    answer = json.loads(raw)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    got = lm_eval_parse_logprobs(answer, [len(c) for c, _ in requests])
    for (context, continuation), (total, greedy) in zip(requests, got):
        scored = oracle.logprobs(context + continuation, top=1)[len(context):]
        if not max_tokens:  # the entries end at the prompt: lm-eval's [ctxlen:-1] drops its last token
            scored = scored[:-1]
        assert total == pytest.approx(sum(r.logprob for r in scored), abs=1e-6)
        assert greedy == all(r.token == r.top[0][0] for r in scored)
    assert [g for _, g in got][:3] == [True, True, True] and got[3][1] is (max_tokens == 0)  # "\n" is no greedy pick
    assert answer["usage"]["prompt_tokens"] == sum(len(c + k) for c, k in requests)
