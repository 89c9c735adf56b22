"""What the CLI writes around a command's own output: progress (bar on a terminal, lines elsewhere),
and library warnings turned into one notice line each, with the details in a log file."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from kvexport.cli import _Progress

LINE = re.compile(r"^\[\s*\d+\.\ds\] (.*)$")

# a command that warns the ways libraries do: Python warnings (two of one kind), a kvexport
# warning, native code writing to fd 2, a child process warning through Python
NOISY = r"""
import os, subprocess, sys, warnings
import kvexport.cli as cli

class IntelLikeWarning(UserWarning):
    pass
IntelLikeWarning.__module__ = "kvexport_intel"

def noisy(a):
    progress = cli._Progress()
    progress("step one")
    warnings.warn("old_api is deprecated", FutureWarning)
    warnings.warn("old_api is deprecated, again", FutureWarning)
    warnings.warn("precision bf16 needs AMX-BF16 or AVX512-BF16; running fp32", IntelLikeWarning)
    os.write(2, b"[ WARN ] native library chatter\n")
    subprocess.run([sys.executable, "-c", "import warnings; warnings.warn('from a worker', UserWarning)"])
    progress("step two")
    print("result on stdout")
    return 0

cli.cmd_doctor = noisy
sys.exit(cli.main(sys.argv[1:]))
"""


def _noisy(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    return subprocess.run([sys.executable, "-c", NOISY, *args], capture_output=True, text=True, timeout=120,
                          env={**env, "KVEXPORT_LOG_DIR": str(tmp_path / "logs")})


def test_warnings_become_one_notice_per_kind_with_the_details_in_a_log(tmp_path: Path) -> None:
    p = _noisy(tmp_path, "doctor")
    assert p.returncode == 0, p.stderr
    assert p.stdout == "result on stdout\n"
    err = p.stderr
    assert "Warning:" not in err and "warnings.warn" not in err and "native library chatter" not in err, err
    assert [LINE.match(ln).group(1) for ln in err.splitlines() if LINE.match(ln)] == ["step one", "step two"]
    assert "warning: precision bf16 needs AMX-BF16 or AVX512-BF16; running fp32" in err  # ours: said plainly
    logs = list((tmp_path / "logs").glob("doctor-*.log"))
    assert len(logs) == 1
    notices = [ln for ln in err.splitlines() if ln.startswith("notice:")]
    assert len(notices) == 3, err  # the two FutureWarnings, the worker's UserWarning, the native lines
    assert any(n.startswith("notice: 2 FutureWarnings from ") and "old_api is deprecated" in n for n in notices)
    assert any(n.startswith("notice: 1 UserWarning from ") and "from a worker" in n for n in notices)
    assert any("1 line of library output" in n for n in notices)
    assert all(f"details in {logs[0]} or rerun with --verbose" in n for n in notices)
    log = logs[0].read_text()
    assert log.count("FutureWarning: old_api is deprecated") == 2
    assert "native library chatter" in log and "UserWarning: from a worker" in log


def test_verbose_shows_everything_as_it_comes(tmp_path: Path) -> None:
    for args in (["--verbose", "doctor"], ["doctor", "-v"]):
        p = _noisy(tmp_path, *args)
        assert p.returncode == 0, p.stderr
        assert "FutureWarning: old_api is deprecated" in p.stderr and "native library chatter" in p.stderr
        assert "notice:" not in p.stderr
    assert not (tmp_path / "logs").exists()  # nothing to keep when nothing was held back


def test_a_quiet_run_leaves_no_log(tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "kvexport", "doctor", "--json"], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "KVEXPORT_LOG_DIR": str(tmp_path / "logs")})
    assert p.returncode == 0 and "notice:" not in p.stderr, p.stderr
    assert not list((tmp_path / "logs").glob("*.log"))


def test_the_library_keeps_its_warnings_after_the_cli_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvexport.cli as cli

    def warns(_a: object) -> int:
        warnings.warn("inside the command", UserWarning)
        return 0

    monkeypatch.setattr(cli, "cmd_doctor", warns)
    before = warnings.showwarning
    assert cli.main(["doctor"]) == 0
    assert warnings.showwarning is before
    with pytest.warns(UserWarning, match="outside"):
        warnings.warn("outside", UserWarning)


def test_progress_is_timestamped_lines_when_stderr_is_not_a_terminal() -> None:
    out = io.StringIO()
    p = _Progress(file=out)  # a StringIO is no terminal
    assert p.tty is False
    p("tracing llama")
    p("building the cpu engine")
    p.close()
    lines = out.getvalue().splitlines()
    assert [LINE.match(ln).group(1) for ln in lines] == ["tracing llama", "building the cpu engine"]
    assert "\x1b[" not in out.getvalue()
    quiet = io.StringIO()
    _Progress(True, file=quiet)("nothing")
    assert quiet.getvalue() == ""


def test_progress_on_a_terminal_is_a_bar_with_the_elapsed_time() -> None:
    out = io.StringIO()
    p = _Progress(tty=True, file=out)
    p("tracing llama")
    time.sleep(0.4)  # the live line refreshes on its own while a step runs
    p("building the cpu engine")
    time.sleep(0.3)
    p.close()
    text = out.getvalue()
    assert "\x1b[" in text  # drawn and redrawn in place
    assert re.search(r"tracing llama.*0:00:0\d", text)  # the live line: step, bar, elapsed h:mm:ss
    assert "━" in text  # the bar
    plain = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", text)
    done = [LINE.match(ln.strip()).group(1) for ln in plain.splitlines() if LINE.match(ln.strip())]
    assert done == ["tracing llama", "building the cpu engine"]  # finished steps stay as lines
    assert _Progress._open == []


def test_progress_bar_through_a_real_pseudo_terminal() -> None:
    pty = pytest.importorskip("pty")
    master, slave = pty.openpty()
    code = ("import time\nfrom kvexport.cli import _Progress\np = _Progress()\nassert p.tty\n"
            "p('exporting')\ntime.sleep(0.5)\np('verifying')\ntime.sleep(0.3)\n_Progress.close_all()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=slave, stdout=subprocess.DEVNULL,
                            env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "100"})
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    assert proc.wait(timeout=60) == 0
    text = b"".join(chunks).decode("utf-8", "replace")
    assert "\x1b[" in text and "━" in text
    assert re.search(r"exporting.*0:00:0\d", text)
    assert re.search(r"\[\s*\d+\.\ds\] exporting", text)
