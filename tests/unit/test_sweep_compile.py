"""``hlat compile -m`` (one compile job per graph group, a manifest, the distribution script), the compile cache's
audit and distribution, and ``hlat doctor --manifest``: rendered and run here, without Trainium.

The groups of a grid come from ``hlat graphs plan`` (traced in the NxD lane, ``tests/neuron/test_graph_plan.py``);
here a plan file with the precision ablation's measured grouping stands in for it, so only the rendering is tested.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hlat.deploy.commands import main as deploy_main
from hlat.deploy.neuron_cache import audit, distribute
from hlat.deploy.sweep_compile import MANIFEST

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = str(ROOT / "sweeps")
TRN1 = ["cluster=trn1_1node", "train.global_batch_size=32", "train.micro_batch_size=1"]
"""The precision ablation made valid on one trn1.32xlarge (32 ranks: the global batch must divide by them)."""
ARMS = ["fp32", "bf16", "bf16_sr", "master_weights", "bf16_sr_beta2_0.99"]
GROUPS = [["fp32"], ["bf16", "bf16_sr"], ["bf16_sr_beta2_0.99"], ["master_weights"]]
"""The compile groups ``hlat graphs plan`` measured for the precision ablation (docs/trn1.md)."""


def arm(name: str) -> str:
    return " ".join([f"+precision_arm={name}", *TRN1])


def plan_file(tmp_path: Path) -> Path:
    """A plan.json as ``hlat graphs plan -m`` writes it, with its grouping (the parts ``hlat compile -m`` reads)."""
    arms = [{"name": arm(a), "overrides": arm(a).split(), "refused": None} for a in ARMS]
    groups = [{"arms": [arm(a) for a in g], "representative": arm(g[-1])} for g in GROUPS]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"arms": arms, "compile_groups": groups}))
    return path


def compile_m(tmp_path: Path, *args: str) -> tuple[int, list[Path]]:
    out = tmp_path / "deploy"
    code = deploy_main(["compile", "-m", "--out", str(out), "--run-dir", str(tmp_path / "runs"), *args])
    return code, sorted(out.iterdir()) if out.is_dir() else []


def check_shell(path: Path) -> None:
    """``bash -n`` and (where installed) shellcheck accept the script."""
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if shellcheck is not None:
        r = subprocess.run([shellcheck, str(path)], capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stdout


def test_one_compile_script_per_group_and_a_manifest_of_every_arm(tmp_path: Path) -> None:
    """The precision ablation's 5 arms in 4 compile groups: 4 sbatch scripts, each compiling its representative
    arm under neuron_parallel_compile with the sweep's config, and a manifest mapping every arm to its group; with
    ``--stage`` the jobs compile into the stage and a distribution script copies it to each node's cache."""
    code, files = compile_m(
        tmp_path, "--config-dir", SWEEPS, "--config-name", "precision_ablation", "--target", "slurm",
        "--plan", str(plan_file(tmp_path)), "--stage", "/fsx/neuron-stage", *TRN1,
    )  # fmt: skip
    assert code == 0
    scripts = [f for f in files if f.name.endswith("-compile.sbatch")]
    assert len(scripts) == len(GROUPS)
    manifest = json.loads((tmp_path / "deploy" / MANIFEST).read_text())
    assert manifest["arms"] == {arm(a): i for i, g in enumerate(GROUPS) for a in g}
    assert manifest["stage"] == "/fsx/neuron-stage" and manifest["local_cache"] == "/var/tmp/neuron-compile-cache"
    flags = [g["compiler_flags"] for g in manifest["groups"]]
    assert flags[0].endswith("--auto-cast=none") and "--cache_dir" not in " ".join(flags)
    for script, group in zip(scripts, manifest["groups"], strict=True):
        check_shell(script)
        text = script.read_text()
        words = shlex.split(text.replace("\\\n", " ").strip().splitlines()[-1])
        assert words[:2] == ["srun", "--kill-on-bad-exit=1"] and "neuron_parallel_compile" in words
        assert words[words.index("--config-name") + 1] == "precision_ablation"
        assert group["representative"][0] in words and "train.steps=10" in words
        assert "export NEURON_COMPILE_CACHE_URL=/fsx/neuron-stage" in text
    (distribution,) = [f for f in files if "distribute" in f.name]
    check_shell(distribution)
    assert "--distribute /fsx/neuron-stage --to /var/tmp/neuron-compile-cache" in distribution.read_text()


def test_a_search_over_schedule_keys_compiles_once_without_enumerating_trials(tmp_path: Path) -> None:
    """``lr_warmup_optuna`` searches optimizer.lr and warmup_steps, both host-schedule keys: one script, no plan."""
    code, files = compile_m(tmp_path, "--config-dir", SWEEPS, "--config-name", "lr_warmup_optuna", *TRN1)
    assert code == 0
    (script,) = [f for f in files if f.name.endswith("-compile.sh")]
    check_shell(script)
    manifest = json.loads((tmp_path / "deploy" / MANIFEST).read_text())
    assert list(manifest["arms"]) == [
        "every trial of optimizer.lr=tag(log, interval(1e-4, 1e-2)) optimizer.warmup_steps=range(5, 80, step=5)"
    ]


def test_a_grid_without_a_plan_is_refused_with_the_command_that_plans_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, files = compile_m(tmp_path, "--config-dir", SWEEPS, "--config-name", "precision_ablation", *TRN1)
    assert code == 2 and not files
    assert "hlat graphs plan -m" in capsys.readouterr().err


def entry(root: Path, version: str, name: str, *files: str) -> Path:
    d = root / f"neuronxcc-{version}" / f"MODULE_{name}+d41d8cd9"
    d.mkdir(parents=True)
    for f in files:
        (d / f).write_bytes(b"x" * 10 if f.endswith(".neff") else b"")
    return d


def test_audit_counts_entries_by_state_and_distribution_copies_only_finished_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stage with two compiler versions: entries done, failed, locked (also a locked one that has its NEFF) and
    empty. The audit counts each; distribution copies the pinned version's done entries only, complete, and copies
    nothing the second time."""
    stage, local = tmp_path / "stage", tmp_path / "local"
    v, old = "2.23.6484.0+3b612583", "2.22.12471.0+b4a00d10"
    entry(stage, v, "1", "model.hlo_module.pb", "model.neff", "compile_flags.json")
    entry(stage, v, "2", "model.hlo_module.pb", "model.log")
    entry(stage, v, "3", "model.hlo_module.pb", "model.neff", "model.hlo_module.pb.lock")
    entry(stage, v, "4", "model.hlo_module.pb")
    entry(stage, old, "5", "model.neff")
    (found_old, found) = audit(stage, "2.23.6484.0")
    assert found.matches and not found_old.matches
    assert dict(found.states) == {"done": 1, "failed": 1, "locked": 1, "empty": 1}
    assert deploy_main(["compile", "--audit", str(stage), "--version", "2.23.6484.0"]) == 1  # failed + stale version
    text = capsys.readouterr().out
    assert f"not the pinned compiler (2.23.6484.0): neuronxcc-{old}" in text and "1 failed entries" in text
    done = distribute(stage, local, "2.23.6484.0")
    assert (done.copied, done.present, dict(done.skipped)) == (1, 0, {"failed": 1, "locked": 1, "empty": 1})
    copied = local / f"neuronxcc-{v}" / "MODULE_1+d41d8cd9"
    assert sorted(p.name for p in copied.iterdir()) == ["compile_flags.json", "model.hlo_module.pb", "model.neff"]
    assert [p.name for p in (local / f"neuronxcc-{v}").iterdir()] == ["MODULE_1+d41d8cd9"]  # no temporary left
    again = distribute(stage, local, v)
    assert (again.copied, again.present) == (0, 1)
    assert not (local / f"neuronxcc-{old}").exists()


def test_doctor_refuses_an_image_whose_compiler_is_not_the_manifests(tmp_path: Path) -> None:
    """``hlat doctor --manifest``: the real ``importlib.metadata`` lookup of neuronx-cc, against a package record
    placed on the path (this machine has no neuronx-cc); another version exits 1 naming both, the same passes on."""
    site = tmp_path / "site"
    meta = site / "neuronx_cc-2.23.6484.0+3b612583.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: neuronx-cc\nVersion: 2.23.6484.0+3b612583\n")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = "import sys; from pathlib import Path; from hlat.cli.doctor import check_manifest; "
    code += "print(check_manifest(Path(sys.argv[1])))"
    for pinned, ok in (("2.22.12471.0+b4a00d10", False), ("2.23.6484.0+3b612583", True)):
        manifest = tmp_path / f"{pinned}.json"
        manifest.write_text(json.dumps({"neuronx-cc": pinned}))
        r = subprocess.run([sys.executable, "-c", code, str(manifest)], capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
        problem = r.stdout.strip().splitlines()[-1]
        if ok:
            assert problem == "None", r.stdout
        else:
            assert "this image has neuronx-cc 2.23.6484.0+3b612583" in problem and "2.22.12471.0" in problem
