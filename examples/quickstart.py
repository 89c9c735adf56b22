"""Build the embedded default engine (no download, no GPU), then generate, stream and batch with it."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import kvexport
from kvexport.build import build


def main(workdir: Path) -> None:
    artifact = build(None, workdir / "default.kvx", target="cpu", max_seq=256, progress=print)
    engine = kvexport.load(artifact)

    result = engine.generate("Hello, kvexport!", max_new_tokens=16)
    print("greedy ids:", result.token_ids, "finish:", result.finish_reason)

    for event in engine.stream("Once upon a time", max_new_tokens=8, temperature=0.8, top_p=0.9, seed=0):
        print(event.token_id, repr(event.text))

    batch = engine.generate(["a", "a longer prompt"], max_new_tokens=4)
    print("batch:", [g.token_ids for g in batch])

    try:
        engine.generate("x" * 300, max_new_tokens=8)
    except kvexport.ContextOverflowError as e:
        print("refused:", e)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()))
