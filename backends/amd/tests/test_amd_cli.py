"""`kvexport build --target amd` from the command line: what a user sees on stderr."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_cli_build_shows_progress_and_no_raw_warnings(amd_builds, tmp_path: Path) -> None:
    """torch.export and AOTInductor warn (FutureWarnings, some from compile workers): the CLI sums them up
    in notice lines and keeps the details in a log; no `path:line: SomeWarning:` line or source line."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["KVEXPORT_LOG_DIR"] = str(tmp_path / "logs")
    out = tmp_path / "cli-amd.kvx"
    r = subprocess.run([sys.executable, "-m", "kvexport", "build", str(amd_builds.checkpoint("llama")),
                        "--target", "amd", "--max-seq", "64", "--max-batch", "4", "--threads", "2", "-o", str(out)],
                       capture_output=True, text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stderr
    assert (out / "manifest.json").is_file()
    assert "compiling with AOTInductor" in r.stderr and "artifact ready" in r.stderr
    assert not re.search(r"^\S+:\d+: \w*Warning: |warnings\.warn\(", r.stderr + r.stdout, re.M), r.stderr
    for notice in (ln for ln in r.stderr.splitlines() if ln.startswith("notice:")):
        log = Path(notice.split("details in ", 1)[1].split(" or rerun", 1)[0])
        assert log.parent == tmp_path / "logs" and log.is_file()
