"""`kvexport build`: export the IR, lower it with a backend, verify, and write the artifact atomically."""
from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvexport import backends
from kvexport.backends import BuildOptions
from kvexport.doctor import read_cpu_flags
from kvexport.errors import BackendUnavailableError, InputError, NumericsMismatchError
from kvexport.manifest import check_max_seq, check_output
from kvexport.precision import ALIASES, Resolved, record, resolve

Progress = Callable[[str], None]
PRECISION_ALIASES = ALIASES


def build(
    model_dir: str | Path | None,
    out: str | Path,
    *,
    target: str = "cpu",
    max_seq: int | None = None,
    options: BuildOptions | None = None,
    verify: bool = True,
    progress: Progress | None = None,
) -> Path:
    """Build an artifact. model_dir None builds the embedded default model (nothing downloaded)."""
    say = progress or (lambda _m: None)
    options = options or BuildOptions()
    backend = backends.get(target)
    caps = backend.capabilities()
    # every refusal of the precision flags and --option values comes before the export
    resolved = resolve(backend, options, read_cpu_flags(), say)
    defer = backend.build_options(options).get("defer", False)
    reasons = backend.availability()
    if reasons and not (caps.deferred_build and defer):
        hint = " Pass --defer to package the prepared IR; the engine is then built at first load." if caps.deferred_build else ""
        raise BackendUnavailableError(f"target {target!r} cannot build here: " + "; ".join(reasons) + "." + hint)
    if verify:  # the row first: it needs no import of transformers
        _require_tolerance_row(target, resolved)
        _require_verify_reference()
    check_max_seq(max_seq)
    out = Path(out)
    check_output(out, Path(model_dir) if model_dir is not None else None)
    # torch and the ONNX exporter load only now: a refused build answers in a second, not after their import
    from kvexport.artifact import VERIFY_FILE, export_artifact, finish, open_artifact

    with tempfile.TemporaryDirectory(prefix="kvexport-default-") as tmp:
        if model_dir is None:
            from kvexport.zoo import write_default

            say("writing the embedded default model (trained on Python stdlib sources, byte-level tokenizer)")
            model_dir = write_default(Path(tmp) / "kvx-default-llama")
        model_dir = Path(model_dir)
        staging = out.with_name(out.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        try:
            rings_off = backend.rings_off(options) if caps.ring_cache else None
            export_artifact(model_dir, staging, max_seq=max_seq, cache_style=caps.ir_cache_style,
                            ring=caps.ring_cache and not rings_off, progress=say)
            folder, manifest = open_artifact(staging, verify_hashes=False)
            if rings_off and any(layer["window"] for layer in manifest.cache["layers"]):
                say(f"sliding-window layers keep full-length caches: {rings_off}")
            problems = backend.check(manifest)
            if problems:
                raise InputError(f"target {target!r} cannot lower this model: " + "; ".join(problems))
            say(f"building the {target} engine")
            backend.build(folder, manifest, _with_calibration_text(options, model_dir), say)
            record(backend, folder, manifest, resolved)
            finish(folder, manifest)
            mismatch = None
            if verify and not manifest.raw["target"].get("deferred"):
                mismatch = run_verify(folder, model_dir, progress=say, raise_on_fail=False)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    if mismatch is not None and not mismatch["passed"]:
        # the artifact is complete and says it failed (manifest `verification.passed`): keep it to inspect
        raise NumericsMismatchError(
            f"{out} differs from the reference beyond the tolerance table: {'; '.join(mismatch['failures'])}. "
            f"Details in {out / VERIFY_FILE}; the artifact is kept, marked as failed."
        )
    say(f"artifact ready: {out}")
    return out


def _with_calibration_text(options: BuildOptions, model_dir: Path) -> BuildOptions:
    """The checkpoint's held-out text as the calibration sample, unless the caller gave one."""
    from kvexport.checkpoint import HELDOUT_FILE

    held = model_dir / HELDOUT_FILE
    if options.calibration_text is not None or not held.is_file():
        return options
    return dataclasses.replace(options, calibration_text=held.read_text(encoding="utf-8"))


def _require_tolerance_row(target: str, resolved: Resolved) -> None:
    """An asked-for combination nobody measured has no row to verify against: say so before the export,
    not as a KeyError after minutes of compiling. (A mode left to the backend's device default is checked
    by verify itself.)"""
    from kvexport.tolerances import TOLERANCES, mode_key

    if resolved.weights is None:
        return
    key = mode_key(resolved.weights, resolved.group_size, resolved.kv)
    if (target, key) not in TOLERANCES:
        rows = ", ".join(sorted(k for t, k in TOLERANCES if t == target))
        raise InputError(
            f"target {target!r} has no tolerance row for {key} (weights {resolved.weights}, kv {resolved.kv}), so "
            f"its build could not be verified: this combination was never measured. Rows for {target}: {rows}. "
            "Pick one of those, or pass --no-verify to build it unverified")


def _require_verify_reference() -> None:
    """build verifies against transformers: refuse before the long work when it is missing."""
    from kvexport.errors import ReferenceUnavailableError
    from kvexport.verify import require_reference

    try:
        require_reference()
    except ReferenceUnavailableError as e:
        raise ReferenceUnavailableError(
            f"{e}. To build without verifying, pass --no-verify (build(..., verify=False)); the artifact is then "
            "marked unverified, and `kvexport verify ARTIFACT --reference MODEL_DIR` checks it later"
        ) from e


def run_verify(folder: str | Path, reference_dir: str | Path, *, decode_steps: int = 32,
               progress: Progress | None = None, raise_on_fail: bool = True, no_rebuild: bool = False,
               self_check: bool = False) -> dict:
    """Verify an artifact against a reference checkpoint; record verify.json and the manifest's summary.

    A reference that is not the artifact's model, or a missing transformers (unless self_check),
    is refused before the engine is loaded."""
    from kvexport.artifact import VERIFY_FILE, finish, open_artifact
    from kvexport.runtime.engine import load
    from kvexport.verify import check_reference, require_reference, verify_engine

    if decode_steps < 1:
        raise InputError(f"verify needs at least 1 decode step (--steps), got {decode_steps}")
    folder = Path(folder)
    _, manifest = open_artifact(folder, verify_hashes=False)  # load() below checks the hashes
    check_reference(manifest, reference_dir)
    require_reference(self_check)
    engine = load(folder, **({"no_rebuild": True} if no_rebuild else {}))
    report = verify_engine(engine, reference_dir, decode_steps=decode_steps, self_check=self_check,
                           progress=progress)
    (folder / VERIFY_FILE).write_text(report.to_json())
    manifest = engine.manifest
    s, t, lt = report.summary, report.text, report.other_text
    text_keys = ("source", "positions", "top1_agreement", "mean_kl", "max_kl", "ppl_change")
    manifest.raw["verification"] = {
        "file": VERIFY_FILE, "passed": report.passed, "reference": report.reference, "mode": report.mode,
        **{k: s[k] for k in ("max_abs_logit", "greedy_agreement", "mean_kl")},
        "text": {k: t[k] for k in text_keys},
        **({"other_path_text": {"path": lt["path"], **{k: lt[k] for k in text_keys}}} if lt else {}),
    }
    finish(folder, manifest)
    if progress:
        def row(r: dict[str, Any]) -> str:
            return (f"top-1 {r['top1_agreement']:.4f}, mean KL {r['mean_kl']:.2e}, max KL {r['max_kl']:.2e}, "
                    f"ppl {r['ppl_change']:+.2%}")

        progress(f"verify ({report.mode}): greedy max |dlogit| {s['max_abs_logit']:.2e}, agreement "
                 f"{s['greedy_agreement']:.3f}; {t['source']} {row(t)}"
                 + (f"; other prompt path ({lt['path']}) {row(lt)}" if lt else "")
                 + f" -> {'passed' if report.passed else 'FAILED'}")
    if raise_on_fail and not report.passed:
        raise NumericsMismatchError(
            f"{folder} differs from the reference beyond the tolerance for ({report.backend}, {report.precision}): "
            + "; ".join(report.failures) + f". Details in {folder / VERIFY_FILE}."
        )
    return {"passed": report.passed, "failures": report.failures, "mode": report.mode, "reference": report.reference,
            **report.summary, **report.checks, "text": report.text,
            **({"other_path_text": report.other_text} if report.other_text else {})}
