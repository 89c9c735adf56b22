"""`kvexport build --target amd` from the command line: what a user sees on stderr."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import CLI_FAMILY, PACKAGES

pytestmark = PACKAGES


@pytest.mark.slow
def test_cli_build_shows_progress_and_no_raw_warnings(amd_builds) -> None:
    """torch.export and AOTInductor warn (FutureWarnings, some from compile workers): the CLI sums them up
    in notice lines and keeps the details in a log; no `path:line: SomeWarning:` line or source line.
    The command is the one that builds amd_builds[CLI_FAMILY], the artifact the other amd tests use."""
    out = amd_builds[CLI_FAMILY]
    r = amd_builds.cli
    assert r is not None and r.returncode == 0, r
    assert (out / "manifest.json").is_file()
    assert "compiling with AOTInductor" in r.stderr and "artifact ready" in r.stderr
    assert not re.search(r"^\S+:\d+: \w*Warning: |warnings\.warn\(", r.stderr + r.stdout, re.M), r.stderr
    for notice in (ln for ln in r.stderr.splitlines() if ln.startswith("notice:")):
        log = Path(notice.split("details in ", 1)[1].split(" or rerun", 1)[0])
        assert log.parent == amd_builds.cli_logs and log.is_file()
