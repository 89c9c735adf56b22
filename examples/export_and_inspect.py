"""Write a seeded tiny GPT-2 checkpoint, check it, export its IR and look at the manifest's cache contract."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from kvexport.architectures import config_problems
from kvexport.artifact import export_artifact, open_artifact
from kvexport.checkpoint import read_hf_config
from kvexport.zoo import TINY_CONFIGS, write_checkpoint


def main(workdir: Path) -> None:
    model_dir = write_checkpoint(TINY_CONFIGS["gpt2"], workdir / "tiny-gpt2", seed=0)
    _, problems = config_problems(read_hf_config(model_dir))
    assert not problems, problems
    folder = export_artifact(model_dir, workdir / "tiny-gpt2.kvx", max_seq=128, cache_style="static")
    _, manifest = open_artifact(folder)
    cache = manifest.cache
    print(f"{manifest.raw['model']['family']}: {cache['num_layers']} layers, cache {cache['layout']} "
          f"{cache['dtype']}, capacity dim '{cache['capacity_dim']}' <= {cache['max_seq']}")
    for past, present in manifest.kv_pairs()[:2]:
        print(f"  {past} -> {present}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
