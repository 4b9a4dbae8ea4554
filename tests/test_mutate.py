"""tests/mutate.py, the mutation-testing runner: which places of a module it mutates and how (never a docstring,
comment, message or output), and the scratch copy it runs them in (imported before the working tree)."""

from __future__ import annotations

import subprocess
import sys

from tests import mutate

SOURCE = '''"""Docstring: a < b and c or d, x + 1."""
import logging

LIMIT = 64  # a comment: a < b


def f(a, b: int = 3, *, flag=True):
    """a <= b"""
    print(a < b, a + 1)
    logging.info("%s", a - 1)
    message = f"{a + 1} < {b}"
    text = "a" + message
    if a < b and not flag:
        return min(a, b) - 1
    b += 2
    return a is None or b in (1, 2)


if __name__ == "__main__":
    f(1, 2)
'''


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(SOURCE.splitlines(), start=1) if text in line)


def test_each_kind_of_mutant_in_the_code_and_none_in_text_or_output():
    found = {(m.line, m.what) for m in mutate.mutants(SOURCE)}
    code = line_of("if a < b and not flag")
    assert {(code, "`<` -> `<=`"), (code, "`and` -> `or`"), (code, "`not` dropped")} <= found
    ret = line_of("return min(a, b) - 1")
    assert {(ret, "`min` -> `max`"), (ret, "`-` -> `+`"), (ret, "`1` -> `0`"), (ret, "`1` -> `2`"),
            (ret, "returns None")} <= found
    last = line_of("return a is None")
    assert {(last, "`is` -> `is not`"), (last, "`or` -> `and`"), (last, "`in` -> `not in`")} <= found
    assert (line_of("b += 2"), "`+=` -> `-=`") in found
    assert {(line_of("LIMIT = 64"), "`64` -> `63`"), (line_of("LIMIT = 64"), "`64` -> `65`")} <= found
    defaults = line_of("def f(")
    assert {(defaults, "`3` -> `4`"), (defaults, "`True` -> `False`")} <= found  # defaults, not annotations
    untouched = {line_of(t) for t in ('"""Docstring', '"""a <= b"""', "print(", "logging.info", 'f"{a + 1}',
                                      '"a" + message', '__name__ == "__main__"', "f(1, 2)")}
    assert not {line for line, _ in found} & untouched


def test_a_mutant_changes_one_place_and_compiles():
    for m in mutate.mutants(SOURCE):
        changed = m.apply(SOURCE)
        compile(changed, "<mutant>", "exec")
        before, after = SOURCE.splitlines(), changed.splitlines()
        assert len(before) == len(after) and [i for i, (x, y) in enumerate(zip(before, after)) if x != y] == [m.line - 1]


def test_the_scratch_copy_is_imported_instead_of_the_working_tree(tmp_path):
    root = mutate.scratch_copy(tmp_path)
    assert (root / "cullama" / "cli").resolve() == (root / "cli").resolve()
    (root / "cullama" / "cli" / "probe.py").write_text("")
    probe = ("import cullama, cullama.cli.probe, cullama.kernels_cu as k; "
             "print(cullama.__file__, cullama.cli.probe.__file__, k.SOURCE_DIR)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=root, env=mutate.environment(root), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all(path.startswith(str(tmp_path)) for path in done.stdout.split()), done.stdout
