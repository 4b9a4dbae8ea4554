"""`cullama bench --speculative`: the latency accounting of bursts and the verify timings on a fake target with
a fake clock, the derived figures, a real run on stories260K (replay accepts every draft), the JSON record, and
the options' one-line errors."""

import json

import pytest
from click.testing import CliRunner

from cullama.bench import speculative as sb
from cullama.cli.main import main
from cullama.model.config import preset
from cullama.generation.drafters import PromptLookup, Replay

TINY = preset("tiny")


def truth(position):
    """The fake target's greedy token after `position` cached ids."""
    return (position * 7) % 50 + 3


class FakeTarget:
    """Greedy text truth(p); a pass over r rows costs `row_ns(r)` on a fake clock, a prefill 5 ms."""

    def __init__(self, row_ns, max_seq_len=1024):
        self.now, self.row_ns, self.max_seq_len = 0, row_ns, max_seq_len
        self.cached, self.last, self.rows = [], None, []

    def clock(self):
        return self.now

    def start(self, prompt_ids, params, reuse=False):
        assert params.temperature == 0
        self.cached, self.last = list(prompt_ids), truth(len(prompt_ids))
        self.now += 5_000_000
        return self.last

    def next(self, ahead=False):
        self.cached.append(self.last)
        self.last = truth(len(self.cached))
        self.now += self.row_ns(1)
        self.rows.append(1)
        return self.last

    def verify(self, drafts):
        assert len(drafts) <= self.max_draft()
        accepted = []
        for d in drafts:  # what the batched verify returns, in one pass over len(drafts) + 1 rows
            want = truth(len(self.cached) + 1 + len(accepted))
            accepted.append(want)
            if d != want:
                break
        else:
            accepted.append(truth(len(self.cached) + 1 + len(accepted)))
        self.cached += [self.last, *accepted[:-1]]
        self.last = accepted[-1]
        self.now += self.row_ns(len(drafts) + 1)
        self.rows.append(len(drafts) + 1)
        return accepted

    def max_draft(self):
        return min(8, self.max_seq_len - len(self.cached) - 1)


def test_burst_latencies_are_the_step_then_zeros():
    target = FakeTarget(lambda rows: 1_000_000 + 100_000 * rows)
    prompt = [5, 6, 7]
    script = sb.greedy_continuation(target, prompt, 11)
    assert script == [truth(3 + i) for i in range(11)]
    result = sb.decode_latencies(target, lambda: Replay(script), prompt, 10, 4, samples=20, warmup=1,
                                 clock=target.clock)
    step = 1_500_000  # 5 rows
    assert result.trials == 2 and result.decode_ns == [step, 0, 0, 0, 0] * 4
    assert (result.stats.steps, result.stats.drafted, result.stats.accepted) == (4, 16, 16)
    s = result.summary()
    assert s["p50_ms"] == 0 and s["max_ms"] == pytest.approx(1.5) and s["mean_ms"] == pytest.approx(0.3)
    assert s["tokens_per_s"] == pytest.approx(1e3 / 0.3) and s["tokens_per_step"] == 5


def test_the_last_step_shrinks_to_the_length():
    target = FakeTarget(lambda rows: 10**6)
    script = sb.greedy_continuation(target, [3], 8)
    target.rows.clear()
    result = sb.decode_latencies(target, lambda: Replay(script), [3], 7, 4, samples=7, warmup=0, clock=target.clock)
    assert target.rows == [5, 2] and len(result.decode_ns) == 7  # 5 tokens, then 2: never past L


def test_verify_times_against_the_plain_step():
    target = FakeTarget(lambda rows: 2_000_000 + 50_000 * (rows - 1))
    result = sb.verify_times(target, 50, context=30, ks=(1, 4, 8), reps=3, warmup=1, clock=target.clock)
    assert result.context == 30 and sorted(result.times_ns) == [0, 1, 4, 8]
    rows = {r["k"]: r for r in result.rows()}
    assert rows[0]["p50_ms"] == pytest.approx(2.0) and rows[0]["x_plain"] == pytest.approx(1.0)
    assert rows[4]["p50_ms"] == pytest.approx(2.2) and rows[4]["x_plain"] == pytest.approx(1.1)
    assert rows[8]["x_plain"] == pytest.approx(1.2) and all(r["all_accepted"] == r["reps"] == 3 for r in rows.values())


def test_derived_figures_divide_the_k4_verify_time():
    target = FakeTarget(lambda rows: 2_000_000 + 100_000 * (rows - 1))
    result = sb.run(target, TINY, "replay", lengths=[20], samples=20, warmup=0, prompt_len=4, draft_tokens=4,
                    verify_context=40, verify_reps=2, clock=target.clock,
                    lookup={"model": "stories260K", "k": 4, "tokens": 256, "tokens_per_step": 1.6})
    derived = result.derived()
    step = 2.4  # ms: the k = 4 verify, 5 rows
    assert [d["tokens_per_step"] for d in derived] == [1.75, 2.8, 5.0, 1.6]
    for d in derived:
        assert d["verify_k4_p50_ms"] == pytest.approx(step)
        assert d["implied_ms_per_token"] == pytest.approx(step / d["tokens_per_step"])
    assert "Spec-Bench" in derived[0]["source"] and "stories260K" in derived[3]["source"]
    report = sb.format_report(result)
    assert "derived, not measured" in report and "1.371 ms/token" in report  # 2.4 / 1.75


def test_ngram_on_random_text_drafts_rarely_but_stays_exact():
    target = FakeTarget(lambda rows: 10**6)
    result = sb.decode_latencies(target, PromptLookup, [9, 10, 11], 60, 4, samples=60, warmup=0, clock=target.clock)
    assert result.stats.accepted + result.stats.steps == 60  # every token came from a step
    # truth() repeats with period 50, so once the text wraps the lookups hit
    assert result.stats.accepted > 0


def test_a_real_run_on_stories260k(stories_dir, tmp_path):
    import cullama

    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu")
    lookup = sb.lookup_tokens_per_step(llm.runner, llm.config.bos_token_id, k=4, tokens=64)
    assert lookup["tokens"] == 64 and lookup["tokens_per_step"] > 1  # its greedy text repeats itself
    result = sb.run(llm.runner, llm.config, "replay", lengths=[16], samples=16, warmup=0, prompt_len=4,
                    draft_tokens=3, verify_context=30, verify_reps=2, lookup={"model": "stories260K", **lookup})
    (s,) = [r.summary() for r in result.lengths]
    assert s["accepted"] == s["drafted"] > 0 and s["tokens_per_step"] == 4  # replay: every draft accepted
    assert {r["k"] for r in result.verify.rows()} == {0, 1, 2, 3, 4, 8}
    assert all(r["all_accepted"] == 2 for r in result.verify.rows())
    sb.write_json(result, tmp_path / "spec.json", model="stories260K")
    record = json.loads((tmp_path / "spec.json").read_text())
    assert record["schema"] == sb.SCHEMA and record["options"]["verify"] == "batched"
    assert record["results"][0]["decode_ns"] == result.lengths[0].decode_ns
    assert len(record["derived"]) == 4 and record["lookup"]["tokens_per_step"] == lookup["tokens_per_step"]


def run(*args):
    return CliRunner().invoke(main, ["bench", "--device", "cpu", *[str(a) for a in args]])


def test_cli_end_to_end(stories_dir, tmp_path):
    out = tmp_path / "b.json"
    result = run("--model", stories_dir, "--speculative", "ngram", "--lengths", 12, "--samples", 12, "--warmup", 0,
                 "--verify-context", 20, "--verify-reps", 2, "--draft-tokens", 2, "--json", out)
    assert result.exit_code == 0, result.output
    assert "cullama bench --speculative ngram" in result.stdout and "derived, not measured" in result.stdout
    record = json.loads(out.read_text())
    assert record["options"]["draft_tokens"] == 2 and record["options"]["command"]["speculative"] == "ngram"
    assert record["verify"]["context"] == 20 and len(record["results"][0]["decode_ns"]) == 12


def test_cli_ctrl_c_keeps_the_lengths_that_finished(stories_dir, tmp_path, monkeypatch):
    real = sb.decode_latencies

    def decode_latencies(runner, make, prompt, length, *args):
        if length == 9:  # as a Ctrl-C would raise it when L=9 starts
            raise KeyboardInterrupt
        return real(runner, make, prompt, length, *args)

    monkeypatch.setattr(sb, "decode_latencies", decode_latencies)
    out = tmp_path / "b.json"
    result = run("--model", stories_dir, "--speculative", "ngram", "--lengths", "6,9", "--samples", 6, "--warmup", 0,
                 "--verify-context", 16, "--verify-reps", 1, "--json", out)
    assert result.exit_code == 130, result.output
    assert result.stderr.splitlines()[-2:] == [f"wrote {out} (interrupted)", "interrupted"]
    record = json.loads(out.read_text())
    assert record["interrupted"] is True and record["verify"] is None and record["derived"] == []
    assert [r["length"] for r in record["results"]] == [6] and len(record["results"][0]["decode_ns"]) == 6
    assert result.stdout.splitlines()[0].endswith(", interrupted")
    assert "interrupted before the verify step's timings" in result.stdout


def test_cli_draft_model(stories_dir):
    result = run("--model", stories_dir, "--speculative", "draft", "--draft-model", stories_dir, "--lengths", 9,
                 "--samples", 9, "--warmup", 0, "--verify-context", 16, "--verify-reps", 1)
    assert result.exit_code == 0, result.output
    line = [l for l in result.stdout.splitlines() if l.split()[:1] == ["9"]][0]
    assert line.split()[-1] == "7/7"  # 4 + 3 drafts (the last step shrinks to L), every one accepted


@pytest.mark.parametrize("args,needle", [
    (["--draft-tokens", "3"], "--draft-tokens needs --speculative"),
    (["--draft-tokens", "0"], "--draft-tokens needs --speculative"),
    (["--verify-reps", "3"], "--verify-reps needs --speculative"),
    (["--speculative", "draft"], "--speculative draft needs it"),
    (["--speculative", "ngram", "--draft-model", "x"], "--draft-model goes with --speculative draft"),
    (["--speculative", "ngram", "--draft-tokens", "16"], "--draft-tokens must be from 1 to 15"),
    (["--speculative", "ngram", "--verify-reps", "0"], "--verify-reps must be an integer >= 1"),
    (["--speculative", "ngram", "--verify-context", "0"], "--verify-context must be an integer >= 1"),
    (["--speculative", "ngram", "--max-seq-len", "9", "--lengths", "1", "--prompt-len", "1"], "no room for a verify"),
])
def test_bad_options_are_one_line(args, needle):
    result = run("--synthetic", "tiny", *args)
    assert result.exit_code == 2, result.output
    (line,) = [l for l in result.stderr.splitlines() if l.startswith("error:")]
    assert needle in line


# -- the device check's report (benchmarks/summarize.py) ----------------------------------------------
def spec_report(directory, record, capsys) -> str:
    from tests.benchmarks.test_summarize import report

    directory.mkdir()
    (directory / "speculative.json").write_text(json.dumps(record))
    return report(directory, capsys)


@pytest.fixture(scope="module")
def spec_record(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / "speculative.json"
    result = run("--synthetic", "tiny", "--speculative", "replay", "--draft-tokens", 4, "--lengths", "10,20",
                 "--samples", 10, "--warmup", 0, "--prompt-len", 2, "--verify-context", 30, "--verify-reps", 2,
                 "--json", path)
    assert result.exit_code == 0, result.output
    return json.loads(path.read_text())


def test_report_section_from_the_real_record(spec_record, tmp_path, capsys):
    from tests.benchmarks.test_summarize import section, table_row, target

    text = spec_report(tmp_path / "r", spec_record, capsys)
    assert spec_record["options"]["verify"] == "batched"
    sec = section(text, "Speculative decoding")
    for r in spec_record["results"]:
        row = table_row(sec, str(r["length"]))
        assert row[2] == f"{r['p50_ms']:.3f}" and row[-1] == f"{r['accepted']}/{r['drafted']}"
    assert table_row(sec, "4")[4] == f"{spec_record['verify']['rows'][3]['x_plain']:.2f}"
    assert "Derived, not measured" in sec and "Spec-Bench prompt lookup, overall" in sec
    x4 = next(r["x_plain"] for r in spec_record["verify"]["rows"] if r["k"] == 4)
    measured, state = target(text, "verify step, k = 4")
    assert measured.startswith(f"{x4:.3f}x the plain step") and "not the target's 500" in measured
    assert state == ("PASS" if x4 <= 1.10 else "FAIL")
    stand_in = {**spec_record, "options": {**spec_record["options"], "verify": "sequential stand-in (next() calls)"}}
    text = spec_report(tmp_path / "stand-in", stand_in, capsys)
    for start in ("verify step, k = 4", "verify step, k = 8", "replay (every draft accepted)"):
        measured, state = target(text, start)
        assert state == "—" and "sequential stand-in" in measured  # a runner without a batched verify: not judged


def test_report_targets_pass_then_fail(spec_record, tmp_path, capsys):
    import copy

    from tests.benchmarks.test_summarize import target

    good = copy.deepcopy(spec_record)
    good["options"]["verify"] = "batched"
    good["verify"]["context"] = 500
    rows = {r["k"]: r for r in good["verify"]["rows"]}
    rows[4].update(x_plain=1.08, p50_ms=3.2)
    rows[8].update(x_plain=1.2)
    for r in good["results"]:
        r["mean_ms"] = 0.75
    text = spec_report(tmp_path / "good", good, capsys)
    assert target(text, "verify step, k = 4") == ("1.080x the plain step (3.200 ms; speculative.json, verify() "
                                                  "calls) at context 500", "PASS")
    assert target(text, "verify step, k = 8")[1] == target(text, "replay (every draft accepted)")[1] == "PASS"

    def flipped(edit, start, needle):
        r = copy.deepcopy(good)
        edit(r)
        measured, state = target(spec_report(tmp_path / f"{start[:10]}{len(list(tmp_path.iterdir()))}", r, capsys),
                                 start)
        assert needle in measured, measured
        return state

    k = lambda n: (lambda r: next(x for x in r["verify"]["rows"] if x["k"] == n))  # noqa: E731
    assert flipped(lambda r: k(4)(r).update(x_plain=1.11), "verify step, k = 4", "1.110x") == "FAIL"
    assert flipped(lambda r: k(8)(r).update(x_plain=1.3), "verify step, k = 8", "1.300x") == "FAIL"
    assert flipped(lambda r: r["results"][1].update(mean_ms=0.81), "replay", "above 0.8 at L=20") == "FAIL"
    assert flipped(lambda r: r["verify"].update(context=300), "verify step, k = 4", "not the target's 500") == "PASS"
    assert flipped(lambda r: r["options"].update(draft_tokens=8), "replay", "not replay with k=4") == "—"
    assert flipped(lambda r: r["verify"].update(rows=[]), "verify step, k = 8", "no k=8 verify time") == "—"


def test_report_verify_targets_prefer_the_decode_steps_graph_timings(spec_record, tmp_path, capsys):
    from tests.benchmarks.test_summarize import report, target

    decode = {"verify": {"context": 500, "steps": 20, "plain_ms": 3.1,
                         "rows": [{"k": 4, "replay_ms": 3.35, "verify_ms": 3.5, "x_plain": 1.081},
                                  {"k": 8, "replay_ms": 3.9, "verify_ms": 4.1, "x_plain": 1.258}]}}
    directory = tmp_path / "both"
    directory.mkdir()
    (directory / "speculative.json").write_text(json.dumps(spec_record))
    (directory / "decode.json").write_text(json.dumps(decode))
    text = report(directory, capsys)
    assert target(text, "verify step, k = 4") == ("1.081x the plain step (3.350 ms; decode.json, its graph "
                                                  "replayed) at context 500", "PASS")
    assert target(text, "verify step, k = 8")[1] == "FAIL"
    assert "speculative.json" not in target(text, "verify step, k = 8")[0]


def test_a_draft_with_another_vocabulary_is_refused_before_any_weight_loads(monkeypatch):
    from cullama import llama as llama_module
    from tests.conftest import load_golden

    def refuse(*args, **kwargs):
        raise AssertionError("weights were loaded before the draft model was checked")

    monkeypatch.setattr(llama_module, "load_checkpoint", refuse)
    monkeypatch.setattr(llama_module.Llama, "synthetic", refuse)
    mha, _, _ = load_golden("tiny-mha")  # a vocabulary of 512
    gqa, _, _ = load_golden("tiny-gqa-sharded")  # 1024, as the tiny preset's
    for model, draft in ((["--model", mha], gqa), (["--synthetic", "tiny"], mha)):
        result = run(*model, "--speculative", "draft", "--draft-model", draft, "--lengths", 4, "--samples", 4)
        assert result.exit_code == 2, result.output
        (line,) = result.stderr.splitlines()
        assert line.startswith("error: ") and "draft model" in line and "512" in line and "1024" in line
