"""Mutation testing: put one small bug at a time into a module and see whether its tests notice.

    .venv/bin/python tests/mutate.py cullama/runtime/sampling.py [--tests tests/runtime/test_sampling.py ...]
        [--limit N] [--jobs 1]

Each mutant changes one place of the module's code: a comparison flipped at its boundary (< and <=, > and >=,
== and !=, is and is not, in and not in), `and` and `or` swapped, an arithmetic or bitwise operator swapped
(+ and -, * and /, // and /, << and >>, & and |, ^ and |, the same in augmented assignments), an integer
constant off by one either way, True and False swapped, a `not` dropped, min and max swapped, a returned value
replaced by None. Docstrings, comments and other strings, f-strings and what is printed or logged are never
mutated. The mutants run one at a time in a scratch copy of the repository (never the working tree: other
runs may be going on in it), each against the module's tests (default: tests/**/test_<module>*.py) with
`pytest -x` and a timeout, and are reported as killed (some test failed), survived (every test passed: a
bug the tests let through, or an equivalent mutant) or timed out (counted as killed: the tests noticed
something). Each survivor is printed with file:line and its mutation, then the score, killed / all.

Not part of the test suite (pytest does not collect this file) and not run in CI: each mutant costs a run of
the module's tests, so a module takes minutes to hours. Run it over the modules an issue changes before
closing the issue, and give the score and every survivor (killed by a new test, or argued equivalent).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import configparser
import dataclasses
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMPARE_FLIPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                 ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
BINARY_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
                ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
                ast.BitXor: ast.BitOr, ast.Mod: ast.FloorDiv}
SYMBOLS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
           ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
           ast.Div: "/", ast.FloorDiv: "//", ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|",
           ast.BitXor: "^", ast.Mod: "%", ast.And: "and", ast.Or: "or"}
# Calls whose arguments are what a user reads, not what the code computes.
OUTPUT_CALLS = {"print", "echo", "secho", "warn"}
OUTPUT_OWNERS = {"logging", "logger", "log", "warnings"}


@dataclasses.dataclass(frozen=True)
class Mutant:
    line: int  # 1-based, where the change starts
    start: int  # character offsets into the source: source[start:end] becomes `new`
    end: int
    new: str
    what: str  # e.g. "`<` -> `<=`"

    def apply(self, source: str) -> str:
        return source[:self.start] + self.new + source[self.end:]


class _Finder(ast.NodeVisitor):
    """Walks a module's AST and records a Mutant for each mutable place, located by its tokens."""

    def __init__(self, source: str):
        self.source, self.mutants = source, []
        lines = source.splitlines(keepends=True)
        self._line_starts = [0]
        for line in lines:
            self._line_starts.append(self._line_starts[-1] + len(line))
        # (offset, end offset, text) of every code token: operators, names and numbers (never strings/comments)
        self._tokens = [(self._offset(t.start), self._offset(t.end), t.string)
                        for t in tokenize.generate_tokens(io.StringIO(source).readline)
                        if t.type in (tokenize.OP, tokenize.NAME, tokenize.NUMBER)]

    def _offset(self, position) -> int:
        line, col = position
        return self._line_starts[line - 1] + col

    def _node_span(self, node) -> tuple[int, int]:
        return (self._offset((node.lineno, node.col_offset)), self._offset((node.end_lineno, node.end_col_offset)))

    def _line(self, offset: int) -> int:
        return next(i for i, start in enumerate(self._line_starts) if start > offset)

    def _add(self, start: int, end: int, new: str, what: str) -> None:
        self.mutants.append(Mutant(self._line(start), start, end, new, what))

    def _operator(self, left, right, words: tuple[str, ...]):
        """The span of the operator `words` (one or two tokens) between the nodes left and right."""
        lo, hi = self._node_span(left)[1], self._node_span(right)[0]
        tokens = [t for t in self._tokens if lo <= t[0] and t[1] <= hi]
        for i in range(len(tokens) - len(words) + 1):
            if tuple(t[2] for t in tokens[i:i + len(words)]) == words:
                return tokens[i][0], tokens[i + len(words) - 1][1]
        return None

    def _swap(self, left, right, old, new) -> None:
        span = self._operator(left, right, tuple(SYMBOLS[old].split()))
        if span:
            self._add(*span, SYMBOLS[new], f"`{SYMBOLS[old]}` -> `{SYMBOLS[new]}`")

    # -- what is never mutated --------------------------------------------------------------------
    def visit_Expr(self, node):
        if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):  # a docstring
            self.generic_visit(node)

    def visit_JoinedStr(self, node):  # f-strings: messages
        pass

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Name) and func.id in OUTPUT_CALLS or isinstance(func, ast.Attribute) and (
                func.attr in OUTPUT_CALLS or isinstance(func.value, ast.Name) and func.value.id in OUTPUT_OWNERS):
            return
        if isinstance(func, ast.Name) and func.id in ("min", "max"):
            swapped = "max" if func.id == "min" else "min"
            self._add(*self._node_span(func), swapped, f"`{func.id}` -> `{swapped}`")
        self.generic_visit(node)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)

    def visit_arg(self, node):  # annotations
        pass

    def visit_FunctionDef(self, node):
        for item in (*node.decorator_list, *node.args.defaults, *(d for d in node.args.kw_defaults if d), *node.body):
            self.visit(item)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node):
        test = node.test
        if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__":
            return  # `if __name__ == "__main__":` how the file is run as a script, not what it computes
        self.generic_visit(node)

    # -- what is ------------------------------------------------------------------------------------
    def visit_Compare(self, node):
        for left, op, right in zip([node.left, *node.comparators], node.ops, node.comparators):
            self._swap(left, right, type(op), COMPARE_FLIPS[type(op)])
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        other = ast.Or if isinstance(node.op, ast.And) else ast.And
        for left, right in zip(node.values, node.values[1:]):
            self._swap(left, right, type(node.op), other)
        self.generic_visit(node)

    def visit_BinOp(self, node):
        if any(isinstance(side, ast.JoinedStr) or isinstance(side, ast.Constant) and isinstance(side.value, str)
               for side in (node.left, node.right)):
            return  # a message put together ("..." + x, "%s" % x)
        if type(node.op) in BINARY_SWAPS:
            self._swap(node.left, node.right, type(node.op), BINARY_SWAPS[type(node.op)])
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        new = BINARY_SWAPS.get(type(node.op))
        if new:
            lo, hi = self._node_span(node.target)[1], self._node_span(node.value)[0]
            old_text = SYMBOLS[type(node.op)] + "="
            for start, end, text in self._tokens:
                if lo <= start and end <= hi and text == old_text:
                    self._add(start, end, SYMBOLS[new] + "=", f"`{old_text}` -> `{SYMBOLS[new]}=`")
                    break
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not):
            start = self._node_span(node)[0]
            self._add(start, self._node_span(node.operand)[0], "", "`not` dropped")
        self.generic_visit(node)

    def visit_Constant(self, node):
        start, end = self._node_span(node)
        if isinstance(node.value, bool):
            self._add(start, end, str(not node.value), f"`{node.value}` -> `{not node.value}`")
        elif isinstance(node.value, int):
            text = self.source[start:end]
            for delta in (1, -1):
                new = (hex if text.lower().startswith("0x") else str)(node.value + delta)
                self._add(start, end, new, f"`{text}` -> `{new}`")

    def visit_Return(self, node):
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            self._add(*self._node_span(node.value), "None", "returns None")
        self.generic_visit(node)


def mutants(source: str) -> list[Mutant]:
    """Every mutant of a module's source, in source order; each one compiles."""
    finder = _Finder(source)
    finder.visit(ast.parse(source))
    found = []
    for m in sorted(set(finder.mutants), key=lambda m: (m.start, m.end, m.new)):
        try:
            compile(m.apply(source), "<mutant>", "exec")
        except SyntaxError:
            continue
        found.append(m)
    return found


# -- running ----------------------------------------------------------------------------------------------
def scratch_copy(destination: Path) -> Path:
    """A copy of the repository's files (tracked, and untracked ones git does not ignore) under destination,
    laid out as the installed package is (setup.cfg's package_dir: cullama/cli is cli/, ...), so that with it
    first on PYTHONPATH its own files are imported, never the working tree's."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    root = destination / REPO.name
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    for line in config.get("options", "package_dir", fallback="").splitlines():
        package, _, folder = (part.strip() for part in line.partition("="))
        if "." in package and folder:  # cullama.cli = cli: a link cullama/cli -> ../cli
            link = root.joinpath(*package.split("."))
            if not link.exists():
                link.symlink_to(os.path.relpath(root / folder, link.parent), target_is_directory=True)
    return root


def test_command(tests: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", *tests]


def environment(root: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
               PYTHONDONTWRITEBYTECODE="1")  # a mutant of the same size in the same second: never a stale .pyc
    env.setdefault("CULLAMA_SHARED", str(REPO.parent / "shared"))  # the tests' data, beside the real repo
    return env


LIVE: set = set()  # the test runs in progress: killed with their process groups when the runner is stopped


def run_tests(root: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """("passed" | "failed" | "timeout" | "error", seconds, the output's tail) of the tests in `root`."""
    started = time.monotonic()
    # A session of its own: a timeout or a stop ends whatever the tests started too (servers, compilers).
    proc = subprocess.Popen(test_command(tests), cwd=root, env=environment(root), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    LIVE.add(proc)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        return "timeout", time.monotonic() - started, ""
    finally:
        LIVE.discard(proc)
    # pytest: 0 all passed, 1 some failed, 2 interrupted (a collection error: the mutant broke an import);
    # 3, 4 and 5 (internal error, usage, nothing collected) are the runner's problem, not the mutant's.
    outcome = {0: "passed", 1: "failed", 2: "failed"}.get(proc.returncode, "error")
    return outcome, time.monotonic() - started, output[-2000:]


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def default_tests(module: Path) -> list[str]:
    found = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob(f"test_{module.stem}*.py"))
    if not found:
        sys.exit(f"mutate: no tests/**/test_{module.stem}*.py: name the tests to run with --tests")
    return found


def parse_lines(text: str | None):
    if not text:
        return None
    lines = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        lines.update(range(int(lo), int(hi or lo) + 1))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("module", help="the module to mutate, a path from the repository root")
    parser.add_argument("--tests", nargs="+", help="test files (default: tests/**/test_<module>*.py)")
    parser.add_argument("--limit", type=int, help="run only the first N mutants")
    parser.add_argument("--lines", help="only mutants on these lines, e.g. 40-60,72")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once, each in its own copy")
    parser.add_argument("--timeout", type=float, help="seconds per run (default: 3 x the clean run + 30)")
    parser.add_argument("--list", action="store_true", help="print the mutants and run nothing")
    args = parser.parse_args(argv)

    module = (REPO / args.module).resolve()
    if not module.is_file() or module.suffix != ".py" or REPO not in module.parents:
        parser.error(f"{args.module} is not a Python file of this repository")
    name = str(module.relative_to(REPO))
    source = module.read_text()
    lines = parse_lines(args.lines)
    todo = [m for m in mutants(source) if lines is None or m.line in lines][:args.limit]
    if args.list:
        for m in todo:
            print(f"{name}:{m.line}: {m.what}")
        print(f"{len(todo)} mutants")
        return 0
    tests = args.tests or default_tests(module)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stop cleans up as Ctrl-C does
    return run_all(name, source, todo, tests, args)


def run_all(name: str, source: str, todo: list[Mutant], tests: list[str], args) -> int:
    with tempfile.TemporaryDirectory(prefix="cullama-mutate-") as scratch:
        roots = [scratch_copy(Path(scratch) / str(j)) for j in range(max(1, args.jobs))]
        outcome, seconds, tail = run_tests(roots[0], tests, timeout=3600)
        if outcome != "passed":
            print(tail)
            sys.exit(f"mutate: the tests do not pass on the unmutated code ({outcome}): nothing to measure")
        timeout = args.timeout or 3 * seconds + 30
        print(f"{name}: {len(todo)} mutants; {' '.join(tests)} take {seconds:.0f} s clean, timeout {timeout:.0f} s",
              flush=True)
        free = list(roots)

        def run(mutant: Mutant):
            root = free.pop()
            try:
                (root / name).write_text(mutant.apply(source))
                return mutant, run_tests(root, tests, timeout)[0]
            finally:
                (root / name).write_text(source)
                free.append(root)

        results, interrupted = [], False
        pool = concurrent.futures.ThreadPoolExecutor(max(1, args.jobs))
        try:
            for i, (mutant, outcome) in enumerate(pool.map(run, todo), start=1):
                results.append((mutant, outcome))
                word = {"failed": "killed", "passed": "SURVIVED", "timeout": "timed out"}.get(outcome, outcome)
                print(f"[{i}/{len(todo)}] {word:9} {name}:{mutant.line}: {mutant.what}", flush=True)
        except (KeyboardInterrupt, SystemExit):  # Ctrl-C or SIGTERM: stop the runs, report what is done
            interrupted = True
            pool.shutdown(wait=False, cancel_futures=True)
            for proc in list(LIVE):
                kill_group(proc)
        pool.shutdown()

    if interrupted:
        print(f"\ninterrupted after {len(results)} of {len(todo)} mutants")
    counts = {k: sum(1 for _, o in results if o == k) for k in ("failed", "passed", "timeout", "error")}
    survivors = [m for m, o in results if o == "passed"]
    print(f"\n{name}: {counts['failed']} killed, {counts['passed']} survived, {counts['timeout']} timed out"
          + (f", {counts['error']} errors" if counts["error"] else ""))
    for m in survivors:
        print(f"  survived  {name}:{m.line}: {m.what}    | {source.splitlines()[m.line - 1].strip()}")
    scored = len(results) - counts["error"]
    if scored:
        print(f"score {(counts['failed'] + counts['timeout']) / scored:.1%} "
              f"({counts['failed'] + counts['timeout']} of {scored} killed)")
    return 130 if interrupted else 1 if survivors or counts["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
