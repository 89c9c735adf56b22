"""test_hf_init.py's check on the amd target: a checkpoint exactly as `transformers` initializes it builds
(an AOTInductor compile per family, 35-55 s each on 2 cores) and verifies. A file of its own so that
pytest-xdist (--dist loadfile) runs it on one worker while test_hf_init.py runs on the other."""
from __future__ import annotations

from pathlib import Path

import pytest

from test_hf_init import FAMILIES, built_and_verified, hf_builds, hf_checkpoints  # noqa: F401  (its fixtures)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_hf_init_checkpoint_builds_and_verifies_on_amd(family: str,
                                                        hf_builds: dict[tuple[str, str], Path]) -> None:  # noqa: F811
    built_and_verified(hf_builds, family, "amd")
