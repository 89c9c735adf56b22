"""Every file of an artifact is listed in manifest.json with its sha256, and load refuses, before any
engine file is opened, a file that is altered, unlisted, or listed but missing."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import kvexport
from kvexport import backends
from kvexport.artifact import named_files
from kvexport.backends import Backend
from kvexport.errors import ArtifactError
from kvexport.manifest import read

TARGETS = ("cpu", "intel")


@pytest.fixture(scope="module", params=TARGETS)
def built(request: pytest.FixtureRequest, artifacts: dict[str, Path], intel_builds: dict[str, Path]) -> Path:
    return artifacts["llama"] if request.param == "cpu" else intel_builds["llama"]


@pytest.fixture
def engine_opened(built: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Records every call of the artifact's backend's open_session (where engine files are read)."""
    backend = backends.get(read(built).target["backend"])  # type: ignore[index]
    calls: list[Path] = []
    original = type(backend).open_session

    def spy(self: Backend, folder: Path, manifest: Any, **options: Any) -> Any:
        calls.append(folder)
        return original(self, folder, manifest, **options)

    monkeypatch.setattr(type(backend), "open_session", spy)
    return calls


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name != "manifest.json")


def _copy(src: Path, tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def _refused(folder: Path, match: str, opened: list[Path]) -> None:
    with pytest.raises(ArtifactError, match=match) as e:
        kvexport.load(folder)
    assert "kvexport build" in str(e.value)  # says what to do
    assert not opened, "the backend opened the engine before the integrity check refused the artifact"


def test_every_file_is_listed_and_named_files_are_among_them(built: Path) -> None:
    m = read(built)
    assert sorted(m.raw["files"]) == _files(built)  # every file, nothing else
    assert set(named_files(m)) <= set(m.raw["files"])
    assert set(m.target["engine_files"]) <= set(m.raw["files"])  # type: ignore[index]
    assert {"model.onnx", "model.onnx.data", "tokenizer.json"} <= set(m.raw["files"])


def test_intact_copy_loads(built: Path, tmp_path: Path, engine_opened: list[Path]) -> None:
    a = _copy(built, tmp_path, "ok.kvx")
    assert kvexport.load(a).generate([5, 6, 7], 2).token_ids
    assert engine_opened == [a]


def test_a_flipped_byte_in_any_file_is_refused(built: Path, tmp_path: Path, engine_opened: list[Path]) -> None:
    for i, rel in enumerate(_files(built)):
        a = _copy(built, tmp_path, f"flip{i}.kvx")
        path = a / rel
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        path.write_bytes(bytes(raw))
        _refused(a, rf"{rel} does not match the sha256", engine_opened)


def test_a_file_dropped_from_the_listing_is_refused(built: Path, tmp_path: Path, engine_opened: list[Path]) -> None:
    for i, rel in enumerate(_files(built)):
        a = _copy(built, tmp_path, f"unlisted{i}.kvx")
        m = json.loads((a / "manifest.json").read_text())
        del m["files"][rel]
        (a / "manifest.json").write_text(json.dumps(m))
        _refused(a, rf"{rel} is not listed in manifest.json", engine_opened)


def test_an_empty_listing_with_an_edited_engine_is_refused(built: Path, tmp_path: Path,
                                                           engine_opened: list[Path]) -> None:
    """The review's case: `"files": {}` and a flipped byte in an engine file loaded and generated."""
    a = _copy(built, tmp_path, "empty.kvx")
    m = json.loads((a / "manifest.json").read_text())
    m["files"] = {}
    (a / "manifest.json").write_text(json.dumps(m))
    engine_file = a / m["target"]["engine_files"][-1]
    raw = bytearray(engine_file.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    engine_file.write_bytes(bytes(raw))
    _refused(a, "lists no sha256", engine_opened)


@pytest.mark.parametrize("extra", ["notes.txt", "engine/extra.bin", "sub/dir/x.py"])
def test_an_unlisted_extra_file_is_refused(built: Path, tmp_path: Path, engine_opened: list[Path], extra: str) -> None:
    a = _copy(built, tmp_path, "extra.kvx")
    (a / extra).parent.mkdir(parents=True, exist_ok=True)
    (a / extra).write_text("not part of the build\n")
    _refused(a, rf"{extra} is not listed in manifest.json", engine_opened)


def test_a_listed_file_that_is_missing_is_refused(built: Path, tmp_path: Path, engine_opened: list[Path]) -> None:
    for i, rel in enumerate(_files(built)):
        a = _copy(built, tmp_path, f"missing{i}.kvx")
        (a / rel).unlink()
        _refused(a, rf"{rel} is missing from the artifact", engine_opened)


def test_a_backend_cannot_skip_the_check() -> None:
    with pytest.raises(TypeError, match="open_session"):
        class Sneaky(Backend):  # noqa: F841 - defining it is the test
            def load(self, folder: Path, manifest: Any, **options: Any) -> Any:
                return None
