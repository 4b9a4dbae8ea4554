"""`cullama` as a real process, for what click's CliRunner cannot show: a real Ctrl-C (SIGINT) and a standard
output on a full device or a closed pipe. Each ends in one line on stderr and its exit code, never a traceback."""

import os
import signal
import subprocess
import sys

import pytest

CULLAMA = [sys.executable, "-c", "from cullama.cli.main import main; main()"]


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("note: ")]


def test_sigint_during_generation_exits_130_and_keeps_the_text(stories_dir, stories_expected):
    process = subprocess.Popen([*CULLAMA, "generate", "--model", str(stories_dir), "--device", "cpu",
                                "--max-new-tokens", "500", "--ignore-eos", ""],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = process.stdout.read(4)  # the generation is streaming
        process.send_signal(signal.SIGINT)
        rest, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert errors(stderr) == ["interrupted"]
    text = (first + rest).rstrip("\n")
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
