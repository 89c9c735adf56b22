"""The README's test command runs two pytest-xdist workers (--dist loadfile): the session fixtures that
several files share are built once per run by whichever worker asks first (kvexport/testing.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_MAKE = """
import sys, time
from pathlib import Path
from kvexport.testing import made_once

def make(out: Path) -> None:
    with open(sys.argv[2], "a") as log:
        log.write("made\\n")
    time.sleep(1.5)  # long enough that the other process asks while this one is still making
    out.mkdir()
    (out / "payload").write_text("done")

print((made_once(Path(sys.argv[1]), make) / "payload").read_text())
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_two_processes_asking_at_once_make_the_thing_once(tmp_path: Path) -> None:
    log = tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", _MAKE, str(tmp_path / "thing"), str(log)],
                              stdout=subprocess.PIPE, text=True, env=_env()) for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert [o.strip() for o in outs] == ["done", "done"]  # the waiter saw the finished folder
    assert log.read_text() == "made\n"


def test_a_make_that_failed_is_made_again_from_nothing(tmp_path: Path) -> None:
    from kvexport.testing import made_once

    def broken(out: Path) -> None:
        out.mkdir()
        (out / "half").write_text("")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        made_once(tmp_path / "thing", broken)
    made = made_once(tmp_path / "thing", lambda out: out.mkdir())
    assert made.is_dir() and not any(made.iterdir())  # the half-made folder was not reused
    made_once(tmp_path / "thing", lambda out: pytest.fail("made twice"))
