"""The trained embedded default model, and tokenizers that decode every id of a vocabulary."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvexport.zoo import (BENCH_125M, DEFAULT_MODEL, DEFAULT_MODEL_DIR, HELDOUT_FILE, TINY_CONFIGS, write_named,
                          write_tokenizer)


def _printable_fraction(text: str) -> float:
    return sum(c.isprintable() or c in "\n\t" for c in text) / max(1, len(text))


@pytest.fixture(scope="module")
def default_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_named("default", tmp_path_factory.mktemp("default") / "ckpt")


def test_default_checkpoint_ships_its_weights_tokenizer_and_heldout_text(default_dir: Path) -> None:
    from tokenizers import Tokenizer

    names = {p.name for p in default_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", HELDOUT_FILE} <= names
    assert (default_dir / HELDOUT_FILE).read_bytes() == (DEFAULT_MODEL_DIR / HELDOUT_FILE).read_bytes()
    cfg = json.loads((default_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(default_dir / "tokenizer.json"))
    assert cfg["model_type"] == "llama" and cfg["vocab_size"] == tok.get_vocab_size() == 259
    assert tok.encode("def ").ids == [b + 3 for b in b"def "]


def test_trained_default_perplexity_on_heldout_text_through_transformers(default_dir: Path) -> None:
    """Per-byte perplexity on text it never saw: 8 windows of 512 bytes spread over heldout.txt
    (docs/default-model.md measures all of it: 3.96)."""
    from kvexport.default_model.measure import heldout_ids, hf_window_logits, perplexity

    torch.set_num_threads(2)
    ids = heldout_ids(default_dir)
    step = len(ids) // 8
    spread = np.concatenate([ids[s: s + 512] for s in range(0, 8 * step, step)])  # 512-aligned windows
    ppl = perplexity(hf_window_logits(default_dir), spread, 512)
    assert ppl <= 8.0, ppl


def test_other_seed_gives_random_weights_of_the_same_shape(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    other = write_named("default", tmp_path / "other", seed=1)
    a, b = load_file(str(DEFAULT_MODEL_DIR / "model.safetensors")), load_file(str(other / "model.safetensors"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    assert json.loads((other / "config.json").read_text())["hidden_size"] == DEFAULT_MODEL["hidden_size"]


@pytest.fixture(scope="module")
def default_engine(default_artifact: Path):  # noqa: ANN201
    """The session's `kvexport build` of the default model (tests/conftest.py), not a second build."""
    import kvexport

    return kvexport.load(default_artifact)


def test_built_default_engine_writes_python_like_text(default_engine) -> None:  # noqa: ANN001
    g = default_engine.generate("def ", max_new_tokens=48)
    assert len(g.token_ids) == 48
    assert g.text and _printable_fraction(g.text) >= 0.8, repr(g.text)


@pytest.mark.parametrize("config", [TINY_CONFIGS["llama"], BENCH_125M], ids=["tiny-llama", "bench-125m"])
def test_zoo_tokenizer_decodes_every_id_of_the_vocabulary(config: dict, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    vocab = config["vocab_size"]
    write_tokenizer(tmp_path, vocab)  # the tokenizer alone: no weights written
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == vocab
    empty = [i for i in range(vocab) if not tok.decode([i], skip_special_tokens=False)]
    assert not empty, empty[:10]
    assert tok.encode("Hello").ids == [b + 3 for b in b"Hello"]  # text still encodes byte by byte
    rng = np.random.default_rng(0)
    text = tok.decode([int(i) for i in rng.integers(259, vocab, 32)])
    assert len(text) >= 32 and _printable_fraction(text) >= 0.8
