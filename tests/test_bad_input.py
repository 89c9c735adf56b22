"""Input a user can get wrong, refused with a typed error before any work: output folders whose replacing would
lose data, counts below their minimum, token ids that are not numbers, an IR-only artifact given to `run`."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvexport.errors import ArtifactError, InputError
from kvexport.manifest import MANIFEST_FILE, check_output
from tests.test_cli import kvx


def test_check_output_replaces_only_new_empty_or_kvexport_folders(tmp_path: Path) -> None:
    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    check_output(tmp_path / "new.kvx", ck)  # new: fine
    (tmp_path / "empty").mkdir()
    check_output(tmp_path / "empty", ck)  # empty: fine
    old = tmp_path / "old.kvx"
    old.mkdir()
    (old / MANIFEST_FILE).write_text("{}")
    (old / "model.onnx").write_text("x")
    check_output(old, ck)  # an earlier artifact: replaced when the new one is done
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(InputError, match="not a kvexport artifact"):
        check_output(mine, ck)
    (tmp_path / "afile").write_text("hi")
    with pytest.raises(InputError, match="is a file"):
        check_output(tmp_path / "afile", ck)
    with pytest.raises(InputError, match="the checkpoint being read"):
        check_output(ck, ck)
    with pytest.raises(InputError, match="the checkpoint being read"):
        check_output(tmp_path, ck)  # a folder holding the checkpoint
    assert (mine / "notes.txt").read_text() == "precious" and (ck / "config.json").is_file()


def test_build_and_export_refuse_before_any_work(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from kvexport.artifact import export_artifact
    from kvexport.build import build

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    ck = checkpoints["llama"]
    for make in (lambda o: build(ck, o, verify=False), lambda o: export_artifact(ck, o)):
        with pytest.raises(InputError, match="not a kvexport artifact"):
            make(mine)
        with pytest.raises(InputError, match="the checkpoint being read"):
            make(ck)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert (ck / "config.json").is_file()
    assert not list(tmp_path.glob("*.building")) and not list(tmp_path.glob("*.partial"))
    for bad in (0, -5):
        with pytest.raises(InputError, match="--max-seq must be at least 1"):
            build(ck, tmp_path / "x.kvx", max_seq=bad, verify=False)
        with pytest.raises(InputError, match="--max-seq must be at least 1"):
            export_artifact(ck, tmp_path / "x.kvx", max_seq=bad)
    assert not (tmp_path / "x.kvx").exists()


def test_counts_and_ids_refused_by_the_cli(default_artifact: Path, tmp_path: Path) -> None:
    import kvexport

    engine = kvexport.load(default_artifact)
    with pytest.raises(InputError, match="max_new_tokens must be >= 0"):
        engine.prefill([72, 105], -1)
    messages = tmp_path / "messages.json"
    messages.write_text('[{"role": "user", "content": "hi"}]')
    for args, flag in ((["bench", str(default_artifact), "--new-tokens", "0", "--no-baselines"], "--new-tokens"),
                       (["run", str(default_artifact), "--prompt", "x", "--messages", str(messages)], "--messages"),
                       (["verify", str(default_artifact), "--reference", str(tmp_path), "--steps", "-1"], "decode step"),
                       (["run", str(default_artifact), "--prompt", "1,a", "--ids"], "--ids"),
                       (["run", str(default_artifact), "--prompt", "x", "--threads", "-2"], "--threads"),
                       (["bench", str(default_artifact), "--prompt-lens", "2000", "--no-baselines"], "--prompt-lens"),
                       (["build", "-o", str(tmp_path / "m.kvx"), "--max-seq", "-5", "--no-verify"], "--max-seq")):
        p = kvx(*args, ok=False)
        assert p.returncode == 2 and flag in p.stderr and "Traceback" not in p.stderr, (args, p.stderr)


def test_an_ir_only_artifact_says_to_build_from_its_checkpoint(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import kvexport
    from kvexport.artifact import export_artifact

    ir = export_artifact(checkpoints["llama"], tmp_path / "ir.kvx", max_seq=32)
    with pytest.raises(ArtifactError, match="build one from the checkpoint folder it was exported from") as e:
        kvexport.load(ir)
    assert "CHECKPOINT_DIR" in str(e.value) and f"build {ir}" not in str(e.value)


def test_a_cache_past_the_trained_positions_is_built_with_a_note(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Rotary positions past max_position_embeddings extrapolate (learned ones are refused at load): the export
    goes on and says so, once, and a cache within the trained positions gets no such note."""
    import json

    from kvexport.artifact import export_artifact

    trained = json.loads((checkpoints["llama"] / "config.json").read_text())["max_position_embeddings"]
    said: list[str] = []
    export_artifact(checkpoints["llama"], tmp_path / "long.kvx", max_seq=trained + 16, progress=said.append)
    notes = [m for m in said if "max_position_embeddings" in m]
    assert len(notes) == 1 and str(trained + 16) in notes[0] and "never trained" in notes[0]
    said.clear()
    export_artifact(checkpoints["llama"], tmp_path / "short.kvx", max_seq=trained, progress=said.append)
    assert not [m for m in said if "max_position_embeddings" in m]


def test_an_edited_max_seq_past_the_engine_ends_in_a_typed_error(artifacts: dict[str, Path], tmp_path: Path) -> None:
    """manifest.json is not hashed: one edited to claim more slots than the engine graph was built for lets a long
    prompt reach ONNX Runtime, whose failure inside the step comes back as an ArtifactError naming the manifest."""
    import json
    import shutil

    import numpy as np

    import kvexport

    edited = tmp_path / "edited.kvx"
    shutil.copytree(artifacts["llama"], edited)
    m = json.loads((edited / MANIFEST_FILE).read_text())
    built = m["cache"]["max_seq"]
    m["cache"]["max_seq"] = built * 8
    (edited / MANIFEST_FILE).write_text(json.dumps(m))
    engine = kvexport.load(str(edited), threads=1)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, 200, engine.max_seq - 4)]
    with pytest.raises(ArtifactError, match="manifest.json may not match"):
        engine.prefill(ids, 2)
