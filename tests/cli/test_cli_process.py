"""`cullama` as a real process, for what click's CliRunner cannot show: a real Ctrl-C (SIGINT), one during the
imports, and a standard output on a full device or a closed pipe. Each ends in one line on stderr and its exit
code, never a traceback."""

import configparser
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

CULLAMA = [sys.executable, "-c", "from cullama.cli import run; run()"]


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("note: ")]


def as_a_shell_starts_it() -> None:
    """In the child before exec: SIGINT at its default and no signal blocked, as a shell starts a command, whatever
    the test process's own state after the tests before (runs of the whole suite have seen the child ignore it)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def signal_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as status:
            return " ".join(line.replace("\t", " ").strip() for line in status if line.startswith(("SigBlk", "SigIgn",
                                                                                                     "SigCgt")))
    except OSError:
        return "no /proc"


def test_sigint_during_generation_exits_130_and_keeps_the_text(stories_dir, stories_expected):
    # In runs of the whole suite the child has ended 0 with its whole text (1,484 characters) though it still ran
    # when signalled; never in runs of this alone or after the same earlier tests. So the child starts as a shell
    # starts it, a run that ends 0 is tried again (up to three times), and a failure says the child's signal state.
    # A child that ignores SIGINT ends 0 every time and fails below.
    for _ in range(3):
        began = time.monotonic()
        process = subprocess.Popen([*CULLAMA, "generate", "--model", str(stories_dir), "--device", "cpu",
                                    "--max-new-tokens", "500", "--ignore-eos", ""], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, preexec_fn=as_a_shell_starts_it)
        try:
            first = process.stdout.read(4)  # the generation is streaming
            seen_s, running, state = time.monotonic() - began, process.poll() is None, signal_state(process.pid)
            process.send_signal(signal.SIGINT)
            rest, stderr = process.communicate(timeout=60)
        finally:
            process.kill()
        if process.returncode != 0:
            break
    text = (first + rest).rstrip("\n")
    assert process.returncode == 130, (f"{stderr!r}, {len(text)} characters out, the first after {seen_s:.2f} s, "
                                       f"{'running' if running else 'ended'} when signalled ({state})")
    assert errors(stderr) == ["interrupted"]
    assert 4 <= len(text) < 2000 and stories_expected["text"].startswith(text[:len(stories_expected["text"])])


def test_stdout_on_a_full_device_is_one_line_and_exit_1(stories_dir):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        done = subprocess.run([*CULLAMA, "generate", "--model", str(stories_dir), "--device", "cpu",
                               "--max-new-tokens", "20", ""], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=120)
    assert done.returncode == 1, done.stderr
    assert errors(done.stderr) == ["error: cannot write to standard output: No space left on device"]


@pytest.mark.parametrize("args", [["info"], ["kernels", "--arch", "sm_90"], ["--help"], ["generate", "--help"],
                                  ["bench", "-h"], ["--version"]])
def test_every_command_and_clicks_own_output_on_a_full_device(args):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    with open("/dev/full", "w") as full:
        done = subprocess.run([*CULLAMA, *args], stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert errors(done.stderr) == ["error: cannot write to standard output: No space left on device"]


def test_ctrl_c_while_the_commands_import_exits_130():
    """As pip's console script does it, with setup.cfg's entry point: a KeyboardInterrupt raised while
    cullama.cli.main imports (the first ~0.2 s of any command)."""
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    (script,) = parser["options.entry_points"]["console_scripts"].split("\n")[1:]
    module, function = script.split("=")[1].strip().split(":")
    code = f"""
import sys

class Interrupt:
    def find_spec(self, name, path, target=None):
        if name == "cullama.cli.main":
            raise KeyboardInterrupt

sys.meta_path.insert(0, Interrupt())
from {module} import {function}
sys.exit({function}())
"""
    done = subprocess.run([sys.executable, "-c", code, "info"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "interrupted\n" and done.stdout == ""


def test_a_closed_pipe_is_one_line_and_exit_1(stories_dir):
    process = subprocess.Popen([*CULLAMA, "generate", "--model", str(stories_dir), "--device", "cpu",
                                "--max-new-tokens", "500", "--ignore-eos", ""],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        process.stdout.read(4)
        process.stdout.close()  # `| head -c 4`
        stderr = process.stderr.read()
        process.wait(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 1, stderr
    assert errors(stderr) == ["error: cannot write to standard output: Broken pipe"]


@pytest.mark.parametrize("args", [
    ["generate", "--max-new-tokens", "3", ""], ["generate", "--json", "--max-new-tokens", "3", ""],
    ["chat"], ["kernels", "--arch", "sm_90"], ["info"],
    ["bench", "--device", "cpu", "--synthetic", "tiny", "--lengths", "2", "--samples", "2", "--warmup", "0"],
], ids=["generate", "generate --json", "chat", "kernels", "info", "bench"])
def test_a_closed_stdout_is_one_line_and_exit_1_before_any_work(stories_dir, args):
    """`cullama ... >&-`: Python starts with no sys.stdout, and click would print into nothing."""
    if args[0] in ("generate", "chat"):
        args = [args[0], "--model", str(stories_dir), "--device", "cpu", *args[1:]]
    done = subprocess.run([*CULLAMA, *args], stdout=None, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                          text=True, timeout=300, preexec_fn=lambda: os.close(1))
    assert done.returncode == 1, done.stderr
    assert errors(done.stderr) == ["error: cannot write to standard output: it is closed"]
