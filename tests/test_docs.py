"""Every example in README.md and docs/*.md, run as written on the CPU, and every relative link followed (issue 25).

The examples are found by reading the markdown, so a new one is a new test case with no edit here:
- fenced blocks: ```python, each block one case; the blocks of a page run in order in one namespace (a later block
  uses an earlier one's `llm`), which starts empty: each page's Python must be complete;
- ```sh / ```bash blocks, and the indented blocks (4 spaces or more, after a blank line) outside fences: each command
  one case (`\\` and deeper-indented lines continue it; a trailing `# comment` is not part of it).
A case is named page:line, so a failure says where the example is. The docs' placeholders are run as WORKSPACE,
HUB, FILES (and the files a page shows: shown_files) and SUBSTITUTIONS below say; how each kind of command runs is `run_command`'s docstring. An example that
cannot run on the CPU goes in NEEDS_GPU with the reason and the GPU test that covers it (none today). When an example
fails, fix the doc, not this file."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, shared_path

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

# The examples' working directory holds a directory per model name the docs use, of links to a checkpoint in
# ../shared (a real directory, so `cullama serve` names the model as the docs' clients do); `~/models/` and `path/to/`
# are removed (SUBSTITUTIONS), so `--model ~/models/Llama-2-7b-hf` loads ./Llama-2-7b-hf.
WORKSPACE = {
    "Llama-2-7b-hf": "models/stories260K",
    "Llama-2-7b-chat-hf": "models/stories260K",
    "TinyLlama-1.1B": "models/stories260K",  # the draft model: it must share the target's tokenizer
    "DIR": "models/stories260K",
    "SMALL_DIR": "models/stories260K",
    # AWQ and GPTQ as HF packs them (../shared/golden/README.md); they come without a tokenizer, so the test writes
    # one (byte-level, 259 pieces: within their vocabularies of 400 and 300) and a text prompt has ids
    "Llama-2-7B-AWQ": "golden/tiny-awq-g64",
    "Llama-2-7B-GPTQ": "golden/tiny-gptq-asym-g128",
}
# The hub ids the docs use: a HuggingFace hub cache in the working directory (HF_HUB_CACHE, HF_HUB_OFFLINE=1) holds
# each as a snapshot (branch main) of links to a checkpoint in ../shared, so `--model org/name` loads without a network.
HUB = {"TinyLlama/TinyLlama-1.1B-Chat-v1.0": "models/stories260K"}
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"
# The files examples read, written into the working directory from stories260K's documented greedy output
# (its README: 256 ids after BOS, and their text).
FILES = {
    "wiki.test.raw": lambda expected: expected["text"] + "\n",
    "story.ids": lambda expected: " ".join(map(str, [1] + expected["ids"])) + "\n",
}
SERVER = "{server}"  # the URL of the module's `cullama serve` (docs_server)
# (pattern in an example, what runs instead, why): applied to every example's text before it runs
SUBSTITUTIONS = [
    (r"~/models/", "", "the models are directories of the working directory (WORKSPACE)"),
    (r"\bpath/to/", "", "the same"),
    (r"http://(127\.0\.0\.1|localhost):8000", SERVER, "the module's server: stories260K as Llama-2-7b-chat-hf, "
                                                      "on a free port"),
    (r"\b7483\b", "483", "LLaMA-2's id of 'capital' (in 1,450,7483: '<s> The capital') is past stories260K's "
                         "512 ids"),
    (r"([\"'])\.\.\.\1", r"\1Once upon a time\1", "a placeholder prompt"),
    (r"--(max-)?replicas 8\b", r"--\1replicas 2", "a machine of 8 GPUs in the docs; the test's 2 CPUs run 2 replicas "
                                                  "on the CPU"),
]
CHAT_INPUT = "Hello\n"  # `cullama chat` reads its user turns from standard input: one turn
# `cullama bench` runs the tiny CPU protocol (seconds) with these options where the example gives none of its own
BENCH_SMALL = {"--lengths": "10", "--samples": "10", "--warmup": "0"}
BENCH_SPECULATIVE_SMALL = {"--verify-reps": "2"}
# text in an example -> (why it needs a GPU, the test that runs it on one). None today: every example runs on the CPU.
NEEDS_GPU: dict[str, tuple[str, str]] = {}
# where an indented block's line starts with one of these programs (a path's last part: .venv/bin/cullama), it is a
# command; any other indented line after a blank one fails test_every_block_is_an_example_or_says_what_it_is
PROGRAMS = {"cullama", "echo", "python", "python3", "pip", "curl", "bash", "ray", "serve"}
SHELL_LANGUAGES, PYTHON_LANGUAGES = {"sh", "bash", "shell"}, {"python", "py"}
NOT_EXAMPLES = {"", "text", "json"}  # fenced diagrams and outputs


# -- finding the examples ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    page: str  # relative to the repo
    line: int  # the fence's line (Python) or the command's first line (shell), 1-based
    kind: str  # "python" | "shell"
    text: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def fenced_blocks(lines: list[str]):
    """(line of the opening fence, language, the block's text dedented by the fence's indent), and the set of
    line numbers fences cover."""
    blocks, covered, i = [], set(), 0
    while i < len(lines):
        start = FENCE.match(lines[i])
        if not start:
            i += 1
            continue
        indent, fence = len(start["indent"]), start["fence"]
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [line[indent:] if line[:indent].strip() == "" else line.lstrip() for line in lines[i + 1:j]]
        blocks.append((i + 1, start["lang"].lower(), "\n".join(body) + "\n"))
        covered.update(range(i + 1, j + 2))
        i = j + 1
    return blocks, covered


def commands(numbered_lines) -> list[tuple[int, str]]:
    """(first line, command) of shell lines: a line ending in `\\` or followed by deeper-indented lines continues;
    blank lines and whole-line comments are skipped."""
    out: list[tuple[int, str]] = []
    base, joining = None, False
    for number, line in numbered_lines:
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not joining):
            joining = False
            continue
        indent = len(line) - len(line.lstrip(" "))
        if out and (joining or (base is not None and indent > base)):
            out[-1] = (out[-1][0], out[-1][1].removesuffix("\\").rstrip() + " " + stripped)
        else:
            base = indent
            out.append((number, stripped))
        joining = stripped.endswith("\\")
    return out


def indented_lines(lines: list[str], covered: set[int]) -> list[list[tuple[int, str]]]:
    """The indented blocks outside fences: lines indented 4 or more after a blank line, up to the next line
    indented less (blank lines inside a block do not end it)."""
    blocks: list[list[tuple[int, str]]] = []
    block_indent, blank_before = None, True
    for number, line in enumerate(lines, 1):
        if number in covered:
            block_indent, blank_before = None, False
            continue
        if not line.strip():
            blank_before = True
            continue
        indent = len(line) - len(line.lstrip(" "))
        if block_indent is not None and indent >= block_indent:
            blocks[-1].append((number, line))
        elif indent >= 4 and blank_before:
            block_indent = indent
            blocks.append([(number, line)])
        else:
            block_indent = None
        blank_before = False
    return blocks


def program(command: str) -> str:
    """The program a command line starts with, past `VAR=value` assignments (a path's last part)."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return ""
    words = [w for w in words if not ENV_ASSIGNMENT.match(w)] or [""]
    return Path(words[0]).name


def page_blocks(page: Path):
    return blocks_of(str(page.relative_to(REPO)), page.read_text())


def blocks_of(name: str, text: str):
    """(the examples of page `name`, [(line, what) of blocks that are no example: an unknown fence language, an
    indented line that is no command])."""
    lines = text.splitlines()
    examples, strays = [], []
    blocks, covered = fenced_blocks(lines)
    for line, lang, body in blocks:
        if lang in PYTHON_LANGUAGES:
            examples.append(Example(name, line, "python", body))
        elif lang in SHELL_LANGUAGES:
            numbered = list(enumerate(body.splitlines(), line + 1))
            examples += [Example(name, n, "shell", c) for n, c in commands(numbered)]
        elif lang not in NOT_EXAMPLES:
            strays.append((line, f"a ```{lang} block"))
    for block in indented_lines(lines, covered):
        for number, command in commands(block):
            if program(command) in PROGRAMS:
                examples.append(Example(name, number, "shell", command))
            else:
                strays.append((number, f"an indented line that is no command of {sorted(PROGRAMS)}: {command!r}"))
    return sorted(examples, key=lambda e: e.line), strays


EXAMPLES = [example for page in PAGES for example in page_blocks(page)[0]]


# -- the workspace, the server -----------------------------------------------------------------------------------
def byte_level_tokenizer(path: Path) -> None:
    """A tokenizer.json of 259 pieces: <unk>, <s>, </s>, then the 256 bytes (byte-level, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update((char, 3 + i) for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(path))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The examples' working directory (WORKSPACE, FILES)."""
    expected = json.loads(shared_path("models", "stories260K", "expected_greedy.json").read_text())
    root = tmp_path_factory.mktemp("docs")
    for name, source in WORKSPACE.items():
        directory = root / name
        directory.mkdir()
        for file in shared_path(source).iterdir():
            (directory / file.name).symlink_to(file)
        if not any((directory / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
            byte_level_tokenizer(directory / "tokenizer.json")
    for repo_id, source in HUB.items():
        repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
        (repo / "snapshots" / HUB_COMMIT).mkdir(parents=True)
        for file in shared_path(source).iterdir():
            (repo / "snapshots" / HUB_COMMIT / file.name).symlink_to(file)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(HUB_COMMIT)
    for name, make in FILES.items():
        (root / name).write_text(make(expected))
    for name, text in shown_files().items():
        (root / name).write_text(text)
    return root


SHOWN_FILE = re.compile(r"`(?P<name>[\w.-]+)`:$")


def shown_files() -> dict[str, str]:
    """The files the docs show before their examples read them: a fenced block whose line before (blank lines
    skipped) ends with "`NAME`:" is the content of NAME ("Save a schema as `person.json`:")."""
    found = {}
    for page in PAGES:
        lines = page.read_text().splitlines()
        for start, _, text in fenced_blocks(lines)[0]:
            before = next((line for line in reversed(lines[:start - 1]) if line.strip()), "")
            named = SHOWN_FILE.search(before.strip())
            if named:
                assert named["name"] not in found, f"{page.name}: {named['name']} is shown twice"
                found[named["name"]] = text
    return found


@pytest.fixture(scope="module")
def docs_server(workspace, tmp_path_factory):
    """`cullama serve` of the workspace's Llama-2-7b-chat-hf (stories260K) on the CPU, for the curl and OpenAI
    client examples."""
    from tests.serving import running

    with running(workspace / "Llama-2-7b-chat-hf", tmp_path_factory.mktemp("serve")) as server:
        yield server


@pytest.fixture
def on_the_cpu(workspace, monkeypatch):
    """In the workspace, with `auto` meaning the CPU even where a GPU is (the docs' examples run on the CPU), and
    the workspace's hub cache the only one, offline (huggingface_hub reads the variables once, at its import)."""
    from cullama.runtime import device

    monkeypatch.chdir(workspace)
    monkeypatch.setattr(device, "cuda_status", lambda: (False, "tests/test_docs.py runs the docs on the CPU"))
    monkeypatch.setenv("HF_HUB_CACHE", str(workspace / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    try:
        from huggingface_hub import constants
    except ImportError:  # the hub extra: without it, a hub id is one line naming the extra
        return workspace
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(workspace / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return workspace


def substitute(text: str, request) -> str:
    for pattern, replacement, _ in SUBSTITUTIONS:
        text = re.sub(pattern, replacement, text)
    if SERVER in text:
        text = text.replace(SERVER, request.getfixturevalue("docs_server").url)
    return text


# -- running them ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_example(example: Example, on_the_cpu, request):
    for needle, (why, gpu_test) in NEEDS_GPU.items():
        if needle in example.text:
            pytest.skip(f"needs a GPU ({why}); {gpu_test} runs it on one")
    if example.kind == "python":
        how = run_python(example, request)
    else:
        how = run_command(example, substitute(example.text, request))
    request.node.user_properties.append(("docs", how))


_PAGES: dict[str, dict] = {}  # page -> {"namespace": ..., "ran": {line: None or the error}}


@pytest.fixture(scope="module", autouse=True)
def _pages_forgotten():
    """The pages' namespaces (their models) go when the module ends."""
    yield
    _PAGES.clear()


def run_python(example: Example, request) -> str:
    """The page's blocks before this one (once each), then this one, in the page's namespace."""
    state = _PAGES.setdefault(example.page, {"namespace": {"__name__": "__docs__"}, "ran": {}})
    for block in [e for e in EXAMPLES if e.page == example.page and e.kind == "python" and e.line <= example.line]:
        if block.line not in state["ran"]:
            try:
                code = compile("\n" * block.line + substitute(block.text, request), str(REPO / block.page), "exec")
                exec(code, state["namespace"])
                state["ran"][block.line] = None
            except Exception as exc:
                state["ran"][block.line] = f"{type(exc).__name__}: {exc}"
                if block is example:
                    raise
        if state["ran"][block.line] is not None:
            pytest.fail(f"{block} failed ({state['ran'][block.line]}), and {example} runs after it", pytrace=False)
    return "ran"


def run_command(example: Example, text: str) -> str:
    """One shell line, as its program:
    - `cullama ...` (also `.venv/bin/cullama`, `echo TEXT | cullama ...`, `VAR=value cullama ...`): in this process
      (click's CliRunner), in the workspace, which must exit 0. `chat` reads CHAT_INPUT; `bench` gets BENCH_SMALL;
      `serve` is parsed by click, then started (`--host 127.0.0.1 --port 0 --device cpu` for its own) until /health
      answers 200, and stopped. A synopsis (`[--option VALUE]`, `a|b|c`) is parsed only: every option the
      command's, every value (but a METAVAR) of its type, every alternative among its choices.
    - `curl`: run, against the module's server, with `-sS --fail-with-body` (an HTTP error fails).
    - `pip install`: the extras it names are setup.cfg's (pip is not run); `python3 -m venv`: not run;
      `python -m pytest`: the suite itself, not run.
    - `python benchmarks/X.py`, `bash benchmarks/X.sh`: the script exists, and `--help` lists each option given
      (python) or `bash -n` reads it (bash).
    - `ray ...` and `serve ...` (Ray's commands: a cluster across machines, a Ray Serve application): parsed by Ray's
      own click commands, every option theirs and every value of its type (not run), where the ray extra is there.
    Parts joined by `&&` run in turn. Returns how it ran (the test's `docs` property)."""
    words = shlex.split(text, comments=True)
    if Path(words[0]).name == "cullama" and any(w.startswith("[") or "|" in w.strip("|") for w in words):
        return check_synopsis(words)
    parts, hows = [[]], []
    for word in words:
        if word == "&&":
            parts.append([])
        else:
            parts[-1].append(word)
    for part in parts:
        env = {}
        while part and ENV_ASSIGNMENT.match(part[0]):
            key, _, value = part.pop(0).partition("=")
            env[key] = value
        stdin = None
        if "|" in part:
            at = part.index("|")
            assert part[0] == "echo" and part.count("|") == 1, f"a pipe other than `echo TEXT | cullama`: {text}"
            stdin, part = " ".join(part[1:at]) + "\n", part[at + 1:]
        name, args = Path(part[0]).name, part[1:]
        if name == "cullama":
            hows.append(run_cullama(args, stdin, env))
        elif name == "pip":
            hows.append(check_pip(args))
        elif name in ("python", "python3") and args[:2] == ["-m", "venv"]:
            hows.append("not run: makes a virtual environment")
        elif name in ("python", "python3") and args[:2] == ["-m", "pytest"]:
            hows.append("not run: the test suite itself, this file in it")
        elif name in ("python", "python3", "bash") and args and args[0].startswith("benchmarks/"):
            hows.append(check_script(name, args))
        elif name == "curl":
            hows.append(run_curl(args, env))
        elif name in ("ray", "serve"):
            hows.append(check_ray_command(name, args))
        else:
            pytest.fail(f"no way to run `{' '.join(part)}`: add one to run_command", pytrace=False)
    return "; ".join(hows)


def run_cullama(args: list[str], stdin: str | None, env: dict) -> str:
    from click.testing import CliRunner

    from cullama.cli.main import main

    if args[:1] == ["serve"]:
        return start_serve(args[1:], env)
    if args[:1] == ["bench"]:
        small = {**BENCH_SMALL, **(BENCH_SPECULATIVE_SMALL if "--speculative" in args else {})}
        args = args + [w for option, value in small.items() if option not in args for w in (option, value)]
    if args[:1] == ["chat"] and stdin is None:
        stdin = CHAT_INPUT
    result = CliRunner().invoke(main, args, input=stdin, env=env or None)
    assert result.exit_code == 0, f"`cullama {shlex.join(args)}` exited {result.exit_code}:\n{result.output}"
    return "ran"


def click_command(name: str):
    import click

    from cullama.cli.main import main

    command = main.get_command(click.Context(main), name)
    assert command is not None, f"cullama has no command {name!r}"
    return command, click.Context(command, info_name=name)


def start_serve(args: list[str], env: dict) -> str:
    """Parsed (every value converted, as a run would), then started and stopped."""
    from tests.serving import ServerProcess

    command, _ = click_command("serve")
    command.make_context("serve", list(args))  # a wrong option or value: click's usage error, exit 2
    rest, model = [], None
    words = iter(args)
    for word in words:
        if word in ("--host", "--port", "--device"):
            next(words)
        elif word == "--model":
            model = next(words)
        else:
            rest.append(word)
    log = Path(tempfile.mkdtemp(dir=Path.cwd(), prefix="serve-")) / "server.log"
    replicas = any(word in args for word in ("--replicas", "--min-replicas", "--max-replicas"))
    if replicas:  # a local Ray cluster of its own, found and reaped by its temp dir (tests/ray_cluster.py)
        from tests.ray_cluster import ray_env, ray_pids, ray_root, reap

        root = ray_root()
        env = {**ray_env(root), **env}
    server = ServerProcess(Path(model), log, *rest, env={**os.environ, **env})
    try:
        server.wait_ready(240 if replicas else 60)
    finally:
        assert server.stop(signal.SIGTERM, timeout=60 if replicas else 30) == 0, server.log()
        if replicas:
            deadline = time.monotonic() + 15
            while ray_pids(root) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert reap(root) == [], "Ray processes were left behind"
    return "ran: started (--host 127.0.0.1 --port 0 --device cpu), /health 200, stopped"


METAVAR = re.compile(r"^[A-Z][A-Z_]*$")  # N, KEY, PATH, DIR, NAMES, ...


def check_synopsis(words: list[str]) -> str:
    command, ctx = click_command(words[1])
    options = {opt: param for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    arguments = sum(1 for param in command.params if param.param_type_name == "argument")
    words = iter(w.strip("[]") for w in words[2:] if w.strip("[]|"))
    for word in words:
        if not word.startswith("--"):
            assert arguments, f"cullama {command.name} takes no argument: {word!r} is no option's value"
            continue
        name, _, value = word.partition("=")
        assert name in options, f"cullama {command.name} has no option {name}"
        param = options[name]
        if getattr(param, "is_flag", False) or getattr(param, "count", False):
            continue
        value = value or next(words, "")
        assert value, f"{name} takes a value, and the synopsis ends"
        if not METAVAR.match(value):
            for alternative in value.split("|"):
                param.type.convert(alternative, param, ctx)  # click's BadParameter names the option
    return "parse-checked: a synopsis (its options, values and choices)"


def check_pip(args: list[str]) -> str:
    assert args[:1] == ["install"], f"pip {' '.join(args)}: only `pip install` is understood"
    targets = [a for a in args[1:] if not a.startswith("-")]
    extras = configparser.ConfigParser()
    extras.read(REPO / "setup.cfg")
    known = set(extras["options.extras_require"])
    for target in targets:
        found = re.fullmatch(r"(\.|cullama)(\[(?P<extras>[\w,-]+)\])?", target)
        assert found, f"pip install {target}: not this package"
        for extra in (found["extras"] or "").split(","):
            assert not extra or extra in known, f"pip install {target}: setup.cfg has no extra {extra!r}"
    return "checked: setup.cfg has the extras (pip not run)"


def check_script(interpreter: str, args: list[str]) -> str:
    script = REPO / args[0]
    assert script.is_file(), f"{args[0]} does not exist"
    if interpreter == "bash":
        done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return "checked: bash -n reads the script"
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    for option in (a.partition("=")[0] for a in args[1:] if a.startswith("--")):
        assert option in done.stdout, f"{args[0]} --help has no {option}"
    return "checked: the script's --help lists its options"


def check_ray_command(program: str, args: list[str]) -> str:
    ray_scripts = pytest.importorskip("ray.scripts.scripts" if program == "ray" else "ray.serve.scripts",
                                      reason="the ray extra is not installed")
    group = ray_scripts.cli
    import click

    command = group.get_command(click.Context(group), args[0]) if args else None
    assert command is not None, f"`{program}` has no command {args[:1]}"
    command.make_context(args[0], list(args[1:]))  # a wrong option or value: click's usage error
    return f"parse-checked by Ray's `{program} {args[0]}` (not run)"


def run_curl(args: list[str], env: dict) -> str:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    done = subprocess.run(["curl", "-sS", "--fail-with-body", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, f"curl exited {done.returncode}: {done.stderr}{done.stdout}"
    assert done.stdout.strip(), "curl printed nothing"
    return "ran"


# -- the collector itself, and the links ---------------------------------------------------------------------------
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_block_is_an_example_or_says_what_it_is(page):
    """A code block the collector would pass over (an unknown fence language, an indented line that is no command)
    fails here, so no example is silently left unrun: make it ```text, or teach the collector its kind."""
    assert page_blocks(page)[1] == []


def test_the_collector_finds_each_kind_of_example():
    text = "\n".join([
        "Text.", "", "    cullama generate --model DIR \"hi\"   # a comment", "    echo hi | cullama generate \\",
        "        --model DIR", "", "    .venv/bin/cullama bench", "", "- a list item", "",
        "  ```python", "  import cullama", "  ```", "", "```sh", "curl http://x \\", "  -d '{}'", "```", "",
        "```", "a diagram", "```", "",
    ])
    examples, strays = blocks_of("case.md", text)
    assert [(e.line, e.kind, e.text) for e in examples] == [
        (3, "shell", 'cullama generate --model DIR "hi"   # a comment'),
        (4, "shell", "echo hi | cullama generate --model DIR"),
        (7, "shell", ".venv/bin/cullama bench"),
        (11, "python", "import cullama\n"),
        (16, "shell", "curl http://x -d '{}'"),
    ]
    assert strays == []


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    blocks, covered = fenced_blocks(page.read_text().splitlines())
    seen: dict[str, int] = {}
    out = set()
    for number, line in enumerate(page.read_text().splitlines(), 1):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*$", line)
        if heading and number not in covered:
            slug = github_anchor(heading[1])
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*<?(\S+?)>?\s*$", re.M)


def relative_links(page: Path) -> list[tuple[int, str]]:
    lines = page.read_text().splitlines()
    _, covered = fenced_blocks(lines)
    found = []
    for number, line in enumerate(lines, 1):
        if number in covered:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # code spans hold no links
        for match in LINK.finditer(line):
            target = match[1] or match[2]
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                found.append((number, target))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_point_at_files_and_headings(page):
    broken = []
    for number, target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.name}:{number}: {target}: no {file}")
        elif anchor and anchor not in anchors(file):
            broken.append(f"{page.name}:{number}: {target}: no heading #{anchor} in {file.name}")
    assert not broken, "\n".join(broken)


def test_the_pages_have_links_and_examples():
    """The collector and the link reader see what the pages hold (a regex that matches nothing passes the tests
    above): the README links its docs and has examples of both kinds."""
    assert {t for _, t in relative_links(REPO / "README.md")} >= {f"docs/{p.name}" for p in PAGES[1:]}
    kinds = {(e.page, e.kind) for e in EXAMPLES}
    assert {("README.md", "python"), ("README.md", "shell")} <= kinds
