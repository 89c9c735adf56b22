"""The CLI end to end (subprocesses, as a user runs it), the examples and the README's commands."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def kvx(*args: str, cwd: Path | None = None, ok: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, "-m", "kvexport", *args], capture_output=True, text=True, cwd=cwd,
                       timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def test_build_default_then_run_inspect_verify(default_artifact: Path) -> None:
    run = kvx("run", str(default_artifact), "--prompt", "72,105", "--ids", "--max-new-tokens", "5")
    assert len(run.stdout.split()) == 5 and "[5 tokens" in run.stderr
    ins = kvx("inspect", str(default_artifact))
    assert "past_key_values.3.value" in ins.stdout and "cache_len" in ins.stdout and "target: cpu fp32" in ins.stdout
    meta = json.loads(kvx("inspect", str(default_artifact), "--json").stdout)
    assert meta["cache"]["max_seq"] == 256 and meta["verification"]["passed"] is True
    verify = json.loads((default_artifact / "verify.json").read_text())
    assert verify["passed"] and verify["summary"]["greedy_agreement"] == 1.0


def test_verify_and_bench_commands(default_artifact: Path, tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    kvx("make-checkpoint", "default", "-o", str(ref))
    v = kvx("verify", str(default_artifact), "--reference", str(ref), "--steps", "8", "--json", "-q")
    assert json.loads(v.stdout)["passed"] is True
    b = kvx("bench", str(default_artifact), "--reference", str(ref), "--prompts", "8", "--new-tokens", "8",
            "--rounds", "2", "--json", "-q")
    r = json.loads(b.stdout)["prompts"]["8"]
    assert r["engine"]["decode_tok_s"] > 0 and r["ratios"]["decode_vs_hf_cache"] > 0
    paired = r["ratios"]["decode_vs_hf_cache_per_round"]
    assert len(paired) == 2 and min(paired) <= r["ratios"]["decode_vs_hf_cache_median_round"] <= max(paired)
    assert r["engine"]["cache_bytes_copied_per_decode_step"] == 0
    assert r["gemv_floor_tok_s"] > 0 and r["fraction_of_floor"] == pytest.approx(
        r["engine"]["decode_tok_s"] / r["gemv_floor_tok_s"])
    assert r["ratios"]["floor_vs_hf_cache"] == pytest.approx(r["gemv_floor_tok_s"] / r["hf_cache"]["decode_tok_s"])
    text = kvx("bench", str(default_artifact), "--prompts", "8", "--new-tokens", "4", "--no-baselines", "-q").stdout
    assert "decode" in text and "bound" in text and "floor" in text
    v = json.loads(kvx("bench", str(default_artifact), "--prompts", "8", "--new-tokens", "4", "--no-baselines",
                       "--variant", "threads=1", "--rounds", "1", "--json", "-q").stdout)
    one = v["prompts"]["8"][f"other:{default_artifact} [threads=1]"]
    assert one["decode_tok_s"] > 0 and one["decode_ratio_vs_main"] > 0
    bad = kvx("bench", str(default_artifact), "--rounds", "0", "--no-baselines", "-q", ok=False)
    assert bad.returncode != 0 and "--rounds" in bad.stderr and "Traceback" not in bad.stderr


def test_verify_fails_with_exit_4_against_other_weights(default_artifact: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    kvx("make-checkpoint", "default", "-o", str(other), "--seed", "1")
    art = shutil.copytree(default_artifact, tmp_path / "default.kvx")  # a failed verify marks the artifact failed
    p = kvx("verify", str(art), "--reference", str(other), "--steps", "4", "-q", ok=False)
    assert p.returncode == 4 and "verification failed" in p.stderr and "Traceback" not in p.stderr
    assert json.loads((art / "manifest.json").read_text())["verification"]["passed"] is False


def test_export_check_lists_problems(tmp_path: Path) -> None:
    from kvexport.zoo import TINY_CONFIGS, write_checkpoint

    good = write_checkpoint(TINY_CONFIGS["llama"], tmp_path / "good")
    assert "supported" in kvx("export", str(good), "--check").stdout
    cfg = json.loads((good / "config.json").read_text())
    cfg.update(hidden_act="bogus", rope_parameters={"rope_type": "yarn"})
    (good / "config.json").write_text(json.dumps(cfg))
    p = kvx("export", str(good), "--check", ok=False)
    assert p.returncode == 2 and "hidden_act" in p.stdout and "rope_type" in p.stdout


def test_export_check_names_a_gemma_feature_it_does_not_compute(tmp_path: Path) -> None:
    from kvexport.zoo import TINY_CONFIGS, write_checkpoint

    ckpt = write_checkpoint(TINY_CONFIGS["gemma3_text"], tmp_path / "g3")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["use_bidirectional_attention"] = True  # EmbeddingGemma: an encoder
    cfg["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    p = kvx("export", str(ckpt), "--check", ok=False)
    assert p.returncode == 2 and "use_bidirectional_attention" in p.stdout
    assert "rope_parameters.full_attention.rope_type" in p.stdout and "yarn" in p.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["run", "missing.kvx", "--prompt", "x"], "not an artifact folder"),
        (["build", "-o", "x.kvx", "--target", "quantum"], "unknown target 'quantum'"),
        (["build", "no/such/dir", "-o", "x.kvx"], "not a folder"),
        (["export", "no/such/dir", "--check"], "not a folder"),
        (["make-checkpoint", "gpt5", "-o", "x"], "unknown model name"),
        (["build", "-o", "x.kvx", "--precision", "int3"], "--weights is one of fp32, fp16, bf16, int8, int4 or auto"),
    ],
)
def test_clean_cli_errors(args: list[str], needle: str, tmp_path: Path) -> None:
    p = kvx(*args, cwd=tmp_path, ok=False)
    assert p.returncode != 0 and needle in p.stderr and "Traceback" not in p.stderr


def test_overflow_and_bad_ids_from_the_cli(default_artifact: Path) -> None:
    p = kvx("run", str(default_artifact), "--prompt", "a" * 250, "--max-new-tokens", "20", ok=False)
    assert p.returncode == 2 and "max_seq=256" in p.stderr and "Traceback" not in p.stderr
    p = kvx("run", str(default_artifact), "--prompt", "1,99999", "--ids", ok=False)
    assert "outside the vocabulary" in p.stderr and "Traceback" not in p.stderr


def test_doctor_lists_targets_and_isa() -> None:
    out = kvx("doctor").stdout
    assert "AMX-BF16" in out and "NUMA" in out and re.search(r"cpu\s+ready", out)
    r = json.loads(kvx("doctor", "--json").stdout)
    assert set(r["targets"]) >= {"cpu", "intel", "nvidia", "amd"}
    for name, t in r["targets"].items():
        assert t["ready"] or t["why_not"], name  # every missing target says why


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "examples").glob("*.py")))
def test_examples_run(script: str, tmp_path: Path) -> None:
    p = subprocess.run([sys.executable, str(ROOT / "examples" / script), str(tmp_path)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr


def test_readme_python_blocks_run(default_artifact: Path, tmp_path: Path) -> None:
    """The README's Python examples run against the artifact its first command builds."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert blocks
    (tmp_path / "default.kvx").symlink_to(default_artifact)
    for code in blocks:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600)
        assert p.returncode == 0, p.stderr


def test_readme_commands_are_the_ones_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = re.search(r"^(python -m pytest[^\n]*)$", readme, re.M)
    assert test_cmd and test_cmd.group(1) in ci


def test_every_documented_command_line_parses() -> None:
    """Each `kvexport ...` line of a shell block in the README and docs/ names real subcommands and
    flags (the parser rejects a renamed or removed option with exit 2)."""
    import shlex

    from kvexport.cli import parser

    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    lines = []
    for doc in docs:
        for block in re.findall(r"```sh\n(.*?)```", doc.read_text(), re.S):
            text = block.replace("\\\n", " ")
            lines += [(doc.name, ln.split(" #")[0].strip()) for ln in text.splitlines() if ln.strip().startswith("kvexport ")]
    assert len(lines) >= 10
    for name, line in lines:
        argv = shlex.split(line)[1:]
        try:
            parser().parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{name}: `{line}` does not parse (exit {e.code})")


def test_build_takes_a_calibration_text_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--calibration-text FILE reaches the build as the calibration sample; a missing file is refused first."""
    import kvexport.build
    from kvexport.cli import main

    seen = []
    monkeypatch.setattr(kvexport.build, "build", lambda *a, **kw: seen.append(kw["options"]))
    text = tmp_path / "sample.txt"
    text.write_text("def f(x):\n    return x + 1\n", encoding="utf-8")
    assert main(["build", str(tmp_path), "-o", str(tmp_path / "o.kvx"), "--weights", "int4",
                 "--option", "quantizer=gptq", "--calibration-text", str(text)]) == 0
    assert seen[0].calibration_text == text.read_text() and seen[0].extra == {"quantizer": "gptq"}
    assert main(["build", str(tmp_path), "-o", str(tmp_path / "o.kvx")]) == 0
    assert seen[1].calibration_text is None  # build() then takes the checkpoint's heldout.txt, if any
    p = kvx("build", str(tmp_path), "-o", str(tmp_path / "o.kvx"), "--calibration-text", str(tmp_path / "none.txt"),
            ok=False)
    assert p.returncode != 0 and "--calibration-text" in p.stderr and "no such file" in p.stderr
    assert not (tmp_path / "o.kvx").exists()
