"""Regenerate pieces.json: the multi-byte text pieces that `make-checkpoint` tokenizers give ids >= 259.

    python -m kvexport.default_model.pieces

A byte-level BPE (`tokenizers`' BpeTrainer, one thread) learned on the same stdlib files the
default model trains on; the learned tokens, in merge order, that are whole UTF-8 text of two or
more bytes. The file is committed, so tokenizers do not depend on the local Python's stdlib.
"""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIECES_FILE = HERE / "pieces.json"
N_LEARNED = 4096


def learn(n: int = N_LEARNED) -> list[str]:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from kvexport.default_model.train import training_files

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + n, initial_alphabet=alphabet, show_progress=False,
                                  min_frequency=2)
    tok.train([str(p) for p in training_files()], trainer)
    vocab = tok.get_vocab()
    pieces: list[str] = []
    for s, _i in sorted(vocab.items(), key=lambda kv: kv[1]):
        if len(s) < 2:
            continue
        text = tok.decode([vocab[s]])
        if len(text.encode("utf-8")) >= 2 and text not in pieces and "\ufffd" not in text:
            pieces.append(text)
    return pieces


def main() -> int:
    pieces = learn()
    PIECES_FILE.write_text(json.dumps({"python": platform.python_version(), "pieces": pieces}, ensure_ascii=False,
                                      indent=0) + "\n", encoding="utf-8")
    print(f"wrote {len(pieces)} pieces to {PIECES_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
