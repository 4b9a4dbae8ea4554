"""The public API on the CPU: Llama.from_pretrained, generate, stream, logits, stop conditions."""

import dataclasses
import json
import re
import threading

import numpy as np
import pytest

import cullama
from cullama.model.config import preset
from cullama.common.errors import KernelError, OptionError, PromptError, ResourceError, TokenizerError
from cullama.generation.generate import GenerationOptions, StopMatcher
from tests.conftest import load_golden


@pytest.fixture(scope="module")
def stories(stories_dir):
    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


def test_generate_reproduces_stories260k(stories, stories_expected):
    result = stories.generate("", max_new_tokens=256)
    assert result.token_ids == stories_expected["ids"]
    assert result.text == stories_expected["text"]
    assert result.finish_reason == "length" and result.prompt_ids == [1]
    assert len(result.timings.token_s) == 255 and result.timings.tokens_per_s > 0


def test_stream_pieces_concatenate_to_the_text(stories):
    stream = stories.stream([1], max_new_tokens=60)
    pieces = list(stream)
    assert len(pieces) > 10 and "".join(pieces) == stream.result.text


def test_cancel_from_another_thread_ends_a_stream_before_its_next_token(stories, stories_expected, monkeypatch):
    # Its text is all held back (the whole output begins the stop string), so the stream never yields: the
    # cancel still lands once the decode step under way is done.
    real_next, steps = stories.runner.next, []
    stream = stories.stream([1], max_new_tokens=200, stop=stories_expected["text"] + "!")

    def next_token(*args, **kwargs):
        steps.append(1)
        if len(steps) == 5:
            canceller = threading.Thread(target=stream.cancel)  # another thread, while the step runs
            canceller.start()
            canceller.join()
        return real_next(*args, **kwargs)

    monkeypatch.setattr(stories.runner, "next", next_token)
    assert list(stream) == [] and stream.result.finish_reason == "cancelled"
    assert len(steps) == 5 and len(stream.result.token_ids) == 6  # the prefill's token and 5 decode steps'
    monkeypatch.undo()
    assert stories.generate([1], max_new_tokens=8).text == stories.generate([1], max_new_tokens=8).text != ""


def test_logits_match_huggingface():
    directory, cases, logits = load_golden("tiny-gqa-sharded")
    llm = cullama.Llama.from_pretrained(directory, device="cpu")
    for case in cases:
        ours = llm.logits(case["prompt_ids"])
        theirs = logits[case["logits_key"]]
        assert ours.dtype == np.float32 and ours.shape == theirs.shape
        # FP16 weights, activations and KV cache: within FP16 tolerance of HF's FP32 logits
        assert np.max(np.abs(ours - theirs)) <= 2e-2 * max(1.0, np.abs(theirs).max())


def test_eos_ends_generation_unless_ignored():
    directory, cases, _ = load_golden("tiny-mha")
    llm = cullama.Llama.from_pretrained(directory, device="cpu")
    case = cases[0]
    greedy = case["greedy_ids"]
    llm.config = type(llm.config)(**{**llm.config.__dict__, "eos_token_ids": (greedy[4],)})
    stopped = llm.generate(case["prompt_ids"], max_new_tokens=24)
    assert stopped.finish_reason == "eos" and stopped.token_ids == greedy[:4]
    full = llm.generate(case["prompt_ids"], max_new_tokens=24, ignore_eos=True)
    assert full.finish_reason == "length" and full.token_ids == greedy


def test_what_needs_text_is_refused_on_a_model_without_a_tokenizer_and_an_empty_text_without_bos(stories):
    """The fourth sweep: stop strings on a model without a tokenizer were taken and never matched; an empty text on
    Qwen2 (no BOS) was refused saying that an empty text starts from BOS; perplexity("") garbled its message."""
    directory, cases, _ = load_golden("tiny-mha")
    llm = cullama.Llama.from_pretrained(directory, device="cpu")
    with pytest.raises(OptionError, match="^stop needs the model's tokenizer") as refused:
        llm.generate(cases[0]["prompt_ids"], max_new_tokens=4, stop=["x"])
    assert refused.value.option == "stop"
    assert llm.generate(cases[0]["prompt_ids"], max_new_tokens=4, stop=()).finish_reason == "length"
    qwen = cullama.Llama.from_pretrained(load_golden("tiny-qwen2")[0], device="cpu")
    with pytest.raises(PromptError, match="adds no BOS"):
        qwen.generate("", max_new_tokens=2)
    with pytest.raises(OptionError, match="^ids holds 1 token id: a perplexity needs at least 2$"):
        stories.perplexity("")


def test_generation_stops_at_the_end_of_the_context(stories_dir):
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_seq_len=10)
    result = llm.generate([1, 403], max_new_tokens=100)
    assert result.finish_reason == "length" and len(result.token_ids) == 8


def test_bad_requests_are_prompt_errors(stories):
    with pytest.raises(PromptError, match="vocabulary"):
        stories.generate([1, 99999])
    with pytest.raises(PromptError, match="temperature"):
        stories.generate([1], temperature=-1)
    with pytest.raises(PromptError, match="context"):
        stories.generate([1] * 600)
    with pytest.raises(PromptError, match="max_new_tokens"):
        stories.generate([1], max_new_tokens=-1)


@pytest.mark.parametrize("chunks,stops,emitted,stopped", [
    (["Hello wor", "ld!"], ["world"], "Hello ", True),
    (["ab", "c", "d"], ["cx"], "abcd", False),  # "c" is held back until "d" rules out "cx"
    (["a\n", "\nb"], ["\n\n"], "a", True),
    (["xyz"], [], "xyz", False),
])
def test_stop_matcher_holds_back_possible_stops(chunks, stops, emitted, stopped):
    matcher = StopMatcher(stops)
    out = "".join(matcher.feed(c) for c in chunks)
    if not matcher.stopped:
        out += matcher.flush()
    assert out == emitted and matcher.stopped == stopped


# -- requests refused in one line, before anything runs -----------------------------------------------
@pytest.mark.parametrize("prompt,needle", [
    (b"hello", "not bytes"), (bytearray(b"hi"), "not bytearray"), ([1, 1.7], "got 1.7"),
    ([1, np.float32(2.0)], "got np.float32(2.0)"), ([1, True], "got True"), ([1, np.bool_(True)], "bool"),
    ([1, [1, 2]], "got [1, 2]"), ([1, None], "got None"), ([1, "2"], "got '2'"), (7, "not int"), (None, "NoneType"),
    (np.array([1.0, 2.0]), "float64"), (np.array([[1, 2]]), "2-D"), ("a\udcffb", "not valid Unicode"),
])
def test_prompts_of_the_wrong_kind_are_refused(stories, prompt, needle):
    with pytest.raises(PromptError, match=re.escape(needle)):
        stories.generate(prompt, max_new_tokens=2)


def test_token_ids_may_be_numpy_integers(stories):
    expected = stories.generate([1, 403], max_new_tokens=5).token_ids
    assert stories.generate(np.array([1, 403], dtype=np.int64), max_new_tokens=5).token_ids == expected
    assert stories.generate((np.int32(1), np.uint16(403)), max_new_tokens=5).token_ids == expected
    assert stories.logits(np.array([1, 403], dtype=np.int32)).shape == (2, stories.config.vocab_size)


@pytest.mark.parametrize("options,option", [
    ({"max_new_tokens": None}, "max_new_tokens"), ({"max_new_tokens": 2.0}, "max_new_tokens"),
    ({"max_new_tokens": True}, "max_new_tokens"), ({"stop": b"x"}, "stop"), ({"stop": [b"x"]}, "stop"),
    ({"stop": 3}, "stop"), ({"stop": ["a", None]}, "stop"), ({"temperature": None}, "temperature"),
    ({"temperature": "0.5"}, "temperature"), ({"top_k": 3_000_000_000}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"top_p": 1.5}, "top_p"), ({"top_p": float("nan")}, "top_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"reuse_cache": 1}, "reuse_cache"), ({"max_tokens": 3}, "max_tokens"),
    # finite in float64 but not meaningful in the sampler's float32
    ({"temperature": 1e39}, "temperature"), ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"repetition_penalty": 1e-50}, "repetition_penalty"), ({"top_p": 1e-50}, "top_p"),
    ({"temperature": 0.8, "repetition_penalty": 1e-45}, "repetition_penalty"),
])
def test_options_of_the_wrong_type_or_range_name_the_option(stories, options, option):
    with pytest.raises(OptionError) as caught:
        stories.stream([1], **options) if "max_tokens" not in options else \
            GenerationOptions.checked(**options)
    assert caught.value.option == option and str(caught.value).startswith(option)
    assert "\n" not in str(caught.value)


def test_accepted_option_spellings(stories):
    assert stories.generate([1], max_new_tokens=np.int64(3), stop=None).finish_reason == "length"
    assert stories.generate([1], max_new_tokens=3, stop="zzz", ignore_eos=np.bool_(False)).token_ids
    big = stories.generate([1], max_new_tokens=4, temperature=0.7, top_k=10**9, seed=np.uint64(3))
    off = stories.generate([1], max_new_tokens=4, temperature=0.7, top_k=0, seed=3)
    assert big.token_ids == off.token_ids and big.seed == 3  # top_k at or above the vocabulary is off


def test_chat_ids_refuses_bad_text_and_types(stories):
    with pytest.raises(PromptError, match="system prompt is not valid Unicode"):
        stories.chat_ids([{"role": "user", "content": "hi"}], system="\udcff")
    with pytest.raises(PromptError, match="message 0 is not valid Unicode"):
        stories.chat_ids([{"role": "user", "content": "\udcff"}])
    with pytest.raises(PromptError, match="content of type int"):
        stories.chat_ids([{"role": "user", "content": 5}])
    for system in (b"x", 5):
        with pytest.raises(OptionError, match="^system must be a string") as caught:
            stories.chat_ids([{"role": "user", "content": "x"}], system=system)
        assert caught.value.option == "system"
        with pytest.raises(OptionError, match="^system must be a string"):
            stories.fit_chat([{"role": "user", "content": "x"}], system, 16)


# -- what a Generation records -------------------------------------------------------------------------
def test_the_seed_used_is_recorded_and_repeats_the_run(stories):
    drawn = stories.generate([1], max_new_tokens=20, temperature=1.0)
    assert isinstance(drawn.seed, int) and 0 <= drawn.seed < 2**64
    again = stories.generate([1], max_new_tokens=20, temperature=1.0, seed=drawn.seed)
    assert again.token_ids == drawn.token_ids and again.seed == drawn.seed


def test_a_stop_string_cuts_the_text_not_the_ids(stories, stories_expected):
    result = stories.generate("", max_new_tokens=60, stop=["Lily", "zzz"])
    assert result.finish_reason == "stop" and result.stop_string == "Lily"
    assert result.text == "Once upon a time, there was a little girl named "
    decoded = stories.tokenizer.decode(result.token_ids)
    assert decoded.startswith(result.text + "Lily")  # the ids spell the stop string too
    assert result.to_dict()["stop_string"] == "Lily"
    assert stories.generate("", max_new_tokens=5).to_dict()["stop_string"] is None


def test_the_text_reads_after_the_prompts_and_stop_strings_see_it_so(stories):
    """The completion's first piece keeps its space after a prompt with text (stories260K's "...there was" goes on
    " a little girl", not "a little girl"): transformers' decode(prompt + completion)[len(decode(prompt)):], as the
    stream shows it and as stop strings are matched in it."""
    prompt = [1, 403, 407, 261, 378, 432, 383, 286]  # "Once upon a time, there was"
    out = stories.generate(prompt, max_new_tokens=6)
    decode = stories.tokenizer.decode
    assert out.text == decode(prompt + out.token_ids)[len(decode(prompt)):] == " a little girl named"
    stream = stories.stream(prompt, max_new_tokens=6)
    assert "".join(stream) == out.text and stream.result.text == out.text
    assert stories.generate(prompt, max_new_tokens=6, stop=" a").text == ""  # the space is there to match
    assert stories.generate([1], max_new_tokens=3).text == "Once upon a"  # after BOS alone: the text's start


def test_completion_tokens_count_the_eos_as_the_logprobs_do(stories):
    plain = stories.generate([1], max_new_tokens=10)
    llm = cullama.Llama(dataclasses.replace(stories.config, eos_token_ids=(plain.token_ids[3],)), stories.runner,
                        stories.tokenizer, "cpu")
    ended = llm.generate([1], max_new_tokens=10, logprobs=0)
    assert ended.finish_reason == "eos" and ended.token_ids == plain.token_ids[:3]
    assert ended.completion_tokens == len(ended.logprobs) == len(ended.timings.token_s) + 1 == 4
    assert ended.to_dict()["completion_tokens"] == 4 and plain.completion_tokens == len(plain.token_ids) == 10
    cut = llm.generate([1], max_new_tokens=10, stop="upon", logprobs=0)  # a stop string's ids stay counted
    assert cut.finish_reason == "stop" and cut.completion_tokens == len(cut.logprobs) == len(cut.token_ids) == 2


# -- checked at load, before the weights ----------------------------------------------------------------
@pytest.fixture
def weights_never_load(monkeypatch):
    """Fails a test if a checkpoint is opened or its weights read."""
    from cullama import llama as llama_module

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were read before the request was refused")

    monkeypatch.setattr(llama_module.checkpoint, "open_checkpoint", refuse)
    monkeypatch.setattr(llama_module, "load_checkpoint", refuse)


def config_only(tmp_path, **changes):
    """A model directory holding only config.json (no weights at all)."""
    cfg = dataclasses.replace(preset("tiny"), **changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    return tmp_path


@pytest.mark.parametrize("keywords, option", [({}, "path"), ({"draft_model": ""}, "draft_model"),
                                              ({"tokenizer": ""}, "tokenizer")])
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(stories_dir, weights_never_load, keywords,
                                                                        option):
    path = "" if option == "path" else stories_dir
    with pytest.raises(OptionError, match=re.escape('is empty: name a path ("." for the current directory)')) as caught:
        cullama.Llama.from_pretrained(path, device="cpu", **keywords)
    assert caught.value.option == option


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_load(weights_never_load):
    from tests.conftest import shared_path

    directory, _, _ = load_golden("tiny-mha")
    llama2 = shared_path("tokenizers", "llama2", "tokenizer.model")
    with pytest.raises(TokenizerError) as caught:
        cullama.Llama.from_pretrained(directory, device="cpu", tokenizer=llama2)
    assert "32000 pieces" in str(caught.value) and "vocabulary of 512" in str(caught.value)
    # in the caller's terms: the Python argument, and the flag on the command line
    assert str(caught.value).endswith("(name the model's own tokenizer with the tokenizer argument)")
    assert caught.value.for_cli().endswith("(name the model's own tokenizer with --tokenizer)")


def test_errors_name_options_in_the_readers_terms():
    from cullama.common.errors import ConfigError, option

    error = ConfigError(f"use a shorter context ({option('max_seq_len')})")
    assert str(error) == "use a shorter context (the max_seq_len argument)"
    assert error.for_cli() == "use a shorter context (--max-seq-len)"
    assert OptionError("top_p", "must be in (0, 1]").for_cli() == "--top-p must be in (0, 1]"


def test_an_unknown_device_is_named_as_the_argument(stories_dir, weights_never_load):
    for load in (lambda: cullama.Llama.from_pretrained(stories_dir, device="gpu"),
                 lambda: cullama.Llama.synthetic("tiny", device="gpu")):
        with pytest.raises(OptionError) as caught:
            load()
        assert str(caught.value) == "device 'gpu' is not one of auto, cpu, cuda"
        assert caught.value.for_cli() == "--device 'gpu' is not one of auto, cpu, cuda"  # the CLI's, as before


def test_cuda_without_a_gpu_is_named_as_the_argument(stories_dir, weights_never_load, monkeypatch):
    from cullama.runtime import device
    from cullama.common.errors import DeviceError

    monkeypatch.setattr(device, "cuda_status", lambda: (False, "no NVIDIA GPU found"))
    with pytest.raises(DeviceError) as caught:
        cullama.Llama.from_pretrained(stories_dir, device="cuda")
    assert str(caught.value) == "the device argument cuda needs a usable GPU: no NVIDIA GPU found"
    assert caught.value.for_cli() == "--device cuda needs a usable GPU: no NVIDIA GPU found"


@pytest.mark.parametrize("arguments,option,kind", [
    ({"path": 5}, "path", "int"), ({"path": b"/tmp"}, "path", "bytes"), ({"tokenizer": 5}, "tokenizer", "int"),
    ({"tokenizer": b"tokenizer.model"}, "tokenizer", "bytes"), ({"draft_model": 5.0}, "draft_model", "float"),
])
def test_paths_of_the_wrong_type_name_the_argument(stories_dir, weights_never_load, arguments, option, kind):
    arguments = {"path": stories_dir, **arguments}
    with pytest.raises(OptionError) as caught:
        cullama.Llama.from_pretrained(arguments.pop("path"), device="cpu", **arguments)
    assert caught.value.option == option
    assert str(caught.value) == f"{option} must be a str or an os.PathLike, got {kind}"


def test_a_path_may_be_a_str_or_path_like(stories_dir):
    class Where:  # any os.PathLike
        def __fspath__(self):
            return str(stories_dir)

    for path in (str(stories_dir), Where()):
        llm = cullama.Llama.from_pretrained(path, device="cpu", tokenizer=Where().__fspath__() + "/tokenizer.model")
        assert llm.generate([1], max_new_tokens=3).token_ids


@pytest.mark.parametrize("changes,needle", [
    ({"head_dim": 96, "num_heads": 4, "num_kv_heads": 2, "hidden_size": 384}, "head_dim 96"),
    ({"num_heads": 16, "num_kv_heads": 1, "head_dim": 16}, "16 query heads per key/value head"),
    ({"hidden_size": 260}, "hidden_size 260"),
    # past 32 x 8 parts of Σ x² a prepared RMSNorm input carries (plan.MAX_SS_PARTS)
    ({"hidden_size": 8320, "num_heads": 65, "num_kv_heads": 13, "head_dim": 128}, "hidden_size 8320"),
])
def test_shapes_the_kernels_do_not_run_are_refused_before_the_weights(tmp_path, weights_never_load, changes, needle):
    with pytest.raises(KernelError) as caught:
        cullama.Llama.from_pretrained(config_only(tmp_path, **changes), device="cpu")
    assert needle in str(caught.value) and "not supported by cullama's kernels" in str(caught.value)
    assert "GPU" not in str(caught.value)


def test_a_context_too_large_for_memory_is_refused_before_anything_is_allocated(stories_dir, monkeypatch):
    from cullama.runtime import memory

    with pytest.raises(ResourceError) as caught:
        cullama.Llama.from_pretrained(stories_dir, device="cpu", max_seq_len=1_000_000_000)
    message = str(caught.value)
    assert "KV cache" in message and "GiB" in message and "free" in message and "shorter context" in message
    monkeypatch.setattr(memory, "available_ram", lambda: 1 << 20)  # 1 MiB left: even the default is too much
    with pytest.raises(ResourceError, match="the CPU has 1.0 MiB free"):
        cullama.Llama.synthetic("tiny", device="cpu")
    with pytest.raises(OptionError, match="max_seq_len"):
        cullama.Llama.from_pretrained(stories_dir, device="cpu", max_seq_len=2**31)


def test_gpu_memory_is_read_from_cupy(monkeypatch):
    import sys

    from tests import fake_cupy
    from cullama.runtime import memory

    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    free, where = memory.free_bytes("cuda")
    assert free == fake_cupy.DEVICE_MEMORY and where == "the GPU has"
    with pytest.raises(ResourceError, match="the GPU has 16.0 MiB free"):
        memory.check_fits("cuda", {"KV cache": 1 << 30}, "advice")


def test_auto_says_when_it_falls_back_to_the_cpu(stories_dir, monkeypatch):
    from cullama.runtime import device

    monkeypatch.setattr(device, "cuda_status", lambda: (False, "no NVIDIA GPU found"))
    llm = cullama.Llama.from_pretrained(stories_dir, device="auto")
    assert llm.device == "cpu" and llm.notes[0] == "running on the CPU: no NVIDIA GPU found"


# -- chat history ---------------------------------------------------------------------------------------
def test_fit_chat_drops_the_oldest_exchanges(stories_dir):
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_seq_len=128)
    history = []
    for i in range(4):
        history += [{"role": "user", "content": f"Tell me about dog {i}."},
                    {"role": "assistant", "content": "The dog ran."}]
    turn = history + [{"role": "user", "content": "And then?"}]  # 232 tokens; each exchange dropped saves 45
    ids, dropped = llm.fit_chat(turn, "Be brief.", 16)
    assert dropped == 3 and len(ids) == 97
    assert ids == llm.chat_ids(turn[2 * dropped:], system="Be brief.")
    assert llm.fit_chat(turn[-1:], None, 16) == (llm.chat_ids(turn[-1:]), 0)
    with_system = [{"role": "system", "content": "Be brief."}] + turn
    assert llm.fit_chat(with_system, None, 16) == (ids, dropped)  # a system message stays too
    assert len(llm.fit_chat(turn, "Be brief.", 100)[0]) == 52  # room for min(100, half the context)
    with pytest.raises(PromptError, match="leaves no room in the context of 128"):
        llm.fit_chat([{"role": "user", "content": "dog " * 200}], None, 16)


# -- a vocabulary padded past the tokenizer's pieces -------------------------------------------------------
@pytest.fixture(scope="module")
def padded(stories_dir, tmp_path_factory):
    """(the model with no tokenizer, the same with stories260K's 512 pieces): random weights, vocabulary 640."""
    from cullama.model.checkpoint import write_random
    from cullama.model.config import from_pretrained

    config = dataclasses.replace(from_pretrained(stories_dir), vocab_size=640, name="padded")
    directory = write_random(tmp_path_factory.mktemp("padded"), config, seed=3)
    bare = cullama.Llama.from_pretrained(directory, device="cpu")
    return bare, cullama.Llama.from_pretrained(directory, device="cpu", tokenizer=stories_dir / "tokenizer.model")


def test_ids_past_the_tokenizer_are_never_sampled(padded):
    bare, llm = padded
    assert max(bare.generate([1], max_new_tokens=40, ignore_eos=True).token_ids) >= 512  # they would be, else
    for options in ({}, {"temperature": 1.0, "seed": 1}, {"temperature": 2.0, "top_k": 600, "seed": 2},
                    {"temperature": 1.0, "top_p": 0.999, "repetition_penalty": 1.3, "seed": 3}):
        result = llm.generate("Once upon a time", max_new_tokens=40, ignore_eos=True, **options)
        assert len(result.token_ids) == 40 and max(result.token_ids) < 512, options
        assert result.text == llm.tokenizer.decode(result.token_ids)
    # greedy is the argmax over the ids the tokenizer has
    prompt = llm.encode("Once upon a time")
    first = llm.generate(prompt, max_new_tokens=1).token_ids[0]
    assert first == int(np.argmax(llm.logits(prompt)[-1][:512]))
    assert llm.logits(prompt).shape == (len(prompt), 640)  # the logits are the model's, every row


def test_drafts_past_the_tokenizer_change_nothing(padded):
    """Drafts of ids the target never samples (600, 601) after a right one: the same text, the right draft
    accepted."""
    _, llm = padded

    class Padding:  # drafts the next token of `text`, then ids past the tokenizer
        name = "padding"

        def __init__(self, text):
            self.text, self.produced = text, 0

        def reset(self, prompt_ids):
            self.produced = 0

        def extend(self, ids):
            self.produced += len(ids)

        def propose(self, k):
            return (self.text[self.produced:self.produced + 1] + [600, 601])[:k]

    prompt = llm.encode("Once upon a time")
    plain = llm.generate(prompt, max_new_tokens=30, ignore_eos=True)
    drafted = llm.generate(prompt, max_new_tokens=30, ignore_eos=True, speculative=Padding(plain.token_ids))
    assert drafted.token_ids == plain.token_ids and drafted.speculative["accepted"] > 0
    sampled = llm.generate(prompt, max_new_tokens=30, ignore_eos=True, temperature=1.0, seed=4,
                           speculative=Padding(plain.token_ids))
    assert len(sampled.token_ids) == 30 and max(sampled.token_ids) < 512
