"""``hlat launch`` / ``hlat compile``: what they print and write, and the input they refuse (exit 2, one line)."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from hlat.backends import neuron
from hlat.cli import main
from hlat.config import to_run_config
from hlat.deploy import job_name, pytorchjob, sbatch_script, to_yaml, train_overrides
from hlat.deploy.commands import install
from tests.conftest import compose_cfg

ENV = {"NEURON_FUSE_SOFTMAX": "1", "XLA_USE_BF16": "1"}
O7 = ["experiment=hlat_7b", "cluster=trn1_x64", "parallelism=hlat_7b"]
SMALL_TRN = ["cluster=trn1_1node", "train.global_batch_size=256"]  # the tiny model on one trn1 node (dp 32)
ROOT = Path(__file__).resolve().parents[2]
"""The checkout: the rendered scripts run its train.py with this interpreter."""


@pytest.fixture
def fake_neuron_env(monkeypatch: pytest.MonkeyPatch) -> list:
    """hlat.backends.neuron.neuron_env, pure: the same fixed variables for every config (records its calls)."""
    calls: list = []

    def neuron_env(cfg: object) -> dict[str, str]:
        calls.append(cfg)
        return dict(ENV)

    monkeypatch.setattr(neuron, "neuron_env", neuron_env, raising=False)
    return calls


def hlat(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_.value.code, out, err


def test_launch_slurm_prints_the_rendered_script(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_neuron_env: list
) -> None:
    """The preset's cluster.cpus_per_task (128 on trn1), the run directory and MLflow's default store made absolute
    where hlat launch runs, and this interpreter and checkout."""
    monkeypatch.chdir(tmp_path)
    code, out, err = hlat(capsys, "launch", "--target", "slurm", *O7)
    assert (code, err) == (0, "")
    cfg = to_run_config(compose_cfg(*O7))
    name = job_name(cfg, O7)
    pinned = [*O7, f"tracker.uri=sqlite:///{tmp_path}/mlflow.db"]
    expected = sbatch_script(
        cfg, train_overrides(pinned, f"{tmp_path}/outputs/{name}"), ENV, name=name, install=install(), cpus_per_task=128
    )
    assert out == expected
    assert install().python == os.path.abspath(sys.executable) and install().root == str(ROOT)
    assert len(fake_neuron_env) == 1 and fake_neuron_env[0] == cfg


@pytest.mark.usefixtures("fake_neuron_env")
def test_launch_eks_writes_the_manifest(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = [
        "launch",
        "--target",
        "eks",
        "--image",
        "reg/hlat:1",
        "--name",
        "h7",
        "--fsx-claim",
        "lustre",
        "--out",
        str(tmp_path),
        "--",
        *O7,
    ]
    code, out, _ = hlat(capsys, *argv)
    path = tmp_path / "h7.yaml"
    assert (code, out) == (0, f"{path}\n")
    cfg = to_run_config(compose_cfg(*O7))
    expected = pytorchjob(
        cfg, train_overrides(O7, "/fsx/hlat/h7"), ENV, name="h7", image="reg/hlat:1", fsx_claim="lustre"
    )
    assert path.read_text() == to_yaml(expected)
    assert yaml.safe_load(path.read_text())["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 64


@pytest.mark.usefixtures("fake_neuron_env")
def test_launch_torchrun_writes_an_executable_script(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = hlat(
        capsys,
        "launch",
        "--target",
        "torchrun",
        "--run-dir",
        "/fsx/r",
        "--out",
        str(tmp_path),
        *O7,
        "tracker.uri=http://mlflow.internal:5000",
    )
    path = Path(out.strip())
    assert code == 0 and path.parent == tmp_path and path.suffix == ".sh" and os.access(path, os.X_OK)
    text = path.read_text()
    assert text.endswith("parallelism=hlat_7b tracker.uri=http://mlflow.internal:5000 hydra.run.dir=/fsx/r\n")
    assert f"\nexec {shlex.quote(os.path.abspath(sys.executable))} -m torch.distributed.run --nnodes 64 " in text
    assert f"\\\n  {shlex.quote(str(ROOT / 'train.py'))} experiment=hlat_7b " in text
    assert f"\ncd {shlex.quote(str(ROOT))}\n" in text


@pytest.mark.parametrize("target", ["torchrun", "slurm"])
def test_an_omitted_tracker_uri_becomes_an_absolute_store_and_the_run_dir_absolute(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, target: str
) -> None:
    """MLflow's default ./mlflow.db would be each node's (and each requeue's) working directory: pinned where
    ``hlat launch`` runs, like a relative --run-dir."""
    monkeypatch.chdir(tmp_path)
    code, out, _ = hlat(capsys, "launch", "--target", target, "--run-dir", "runs/a", "cluster=cpu", "cluster.nodes=2")
    assert code == 0
    line = next(w for w in out.replace("\\\n", " ").splitlines() if w.startswith(("exec ", "srun ")))
    words = shlex.split(line.removesuffix(" || status=$?"))
    assert words[-2:] == [f"tracker.uri=sqlite:///{tmp_path}/mlflow.db", f"hydra.run.dir={tmp_path}/runs/a"]
    for kept in (["tracker.uri=sqlite:////data/runs.db"], ["tracker=console"]):  # a store of one's own, or none
        _, out, _ = hlat(capsys, "launch", "--target", target, "cluster=cpu", "cluster.nodes=2", *kept)
        assert out.count("tracker.uri=") == len([k for k in kept if k.startswith("tracker.uri")])


def test_the_shells_mlflow_tracking_uri_is_pinned_unless_it_holds_a_password(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The nodes need not share this shell's environment: its store goes into the launch file, as the default would;
    the login of a URI with user-info stays out of it (hlat.cli.main moved it into MLflow's variables, which the
    job's environment must carry)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://team.example:5000")
    _, out, _ = hlat(capsys, "launch", "--target", "torchrun", "cluster=cpu", "cluster.nodes=2")
    assert " tracker.uri=http://team.example:5000 " in out.replace("\\\n", " ")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://alice:s3cr3t@team.example:5000")
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(name, raising=False)  # restored after the test: main() sets them from the URI
    _, out, _ = hlat(capsys, "launch", "--target", "torchrun", "cluster=cpu", "cluster.nodes=2")
    assert " tracker.uri=http://team.example:5000 " in out.replace("\\\n", " ")
    assert "s3cr3t" not in out and "alice" not in out


def test_eks_keeps_the_images_command_and_paths(capsys: pytest.CaptureFixture[str]) -> None:
    """A pod runs the image's torchrun and train.py in its working directory; the store is the image's concern."""
    code, out, _ = hlat(capsys, "launch", "--target", "eks", "--image", "i", "cluster=cpu", "cluster.nodes=2")
    container = yaml.safe_load(out)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert code == 0 and container["command"][0] == "torchrun" and "train.py" in container["command"]
    assert not any(w.startswith("tracker.uri=") for w in container["command"]) and sys.executable not in out


@pytest.mark.parametrize(
    ("argv", "cpus"),
    [
        (["cluster=cpu", "cluster.nodes=2", "cluster.cpus_per_task=6"], "6"),  # the cluster's own count
        (["--cpus-per-task", "4", "cluster=cpu", "cluster.nodes=2", "cluster.cpus_per_task=6"], "4"),  # the flag first
        ([*O7, "cluster.cpus_per_task=64"], "64"),  # the cluster's count before the instance type's 128
        ([*O7, "cluster.cpus_per_task=null"], "128"),  # trn1.32xlarge
        (["cluster=cpu_x2"], None),  # nothing known: every CPU Slurm allocates on the node
    ],
)
@pytest.mark.usefixtures("fake_neuron_env")
def test_cpus_per_task_reaches_sbatch_and_srun(
    capsys: pytest.CaptureFixture[str], argv: list, cpus: str | None
) -> None:
    code, out, err = hlat(capsys, "launch", "--target", "slurm", *argv)
    assert (code, err) == (0, "")
    header = [line for line in out.splitlines() if line.startswith("#SBATCH --cpus-per-task")]
    srun = next(line for line in out.splitlines() if line.startswith("srun "))
    assert header == ([f"#SBATCH --cpus-per-task={cpus}"] if cpus else [])
    expected = cpus or '"$SLURM_CPUS_ON_NODE"'
    assert srun.startswith(f"srun --kill-on-bad-exit=1 --cpus-per-task={expected} {shlex.quote(install().python)} ")


def test_torch_clusters_export_nothing(capsys: pytest.CaptureFixture[str], fake_neuron_env: list) -> None:
    code, out, _ = hlat(
        capsys,
        "launch",
        "--target",
        "slurm",
        "--cpus-per-task",
        "96",
        "cluster=gpu_8x",
        "cluster.nodes=2",
        "train.micro_batch_size=1",
    )
    assert code == 0 and "--gpus-per-node=8" in out and "export NEURON" not in out and not fake_neuron_env


def srun_command(script: str) -> list[str]:
    """The two lines of a batch script's srun command (a run's ends by recording its exit status)."""
    lines = script.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    return [lines[i], lines[i + 1].removesuffix(" || status=$?")]


@pytest.mark.usefixtures("fake_neuron_env")
def test_compile_keeps_the_run_command(capsys: pytest.CaptureFixture[str]) -> None:
    _, run, _ = hlat(capsys, "launch", "--target", "slurm", *O7)
    code, comp, _ = hlat(capsys, "compile", "--target", "slurm", "--steps", "5", *O7)
    assert code == 0
    run_cmd, comp_cmd = srun_command(run), srun_command(comp)
    assert comp_cmd[0] == run_cmd[0].replace(
        "srun --kill-on-bad-exit=1 --cpus-per-task=128 ",
        "srun --kill-on-bad-exit=1 --cpus-per-task=128 neuron_parallel_compile ",
    )
    run_dir = run_cmd[1].split("hydra.run.dir=")[1]
    changed = "train.steps=5 optimizer.warmup_steps=4 train.resume=never tracker.kind=console"
    assert comp_cmd[1] == run_cmd[1].replace(f"hydra.run.dir={run_dir}", f"{changed} hydra.run.dir={run_dir}/compile")
    assert "export NEURON_COMPILE_CACHE_URL=/var/tmp/neuron-compile-cache\n" in comp


@pytest.mark.usefixtures("fake_neuron_env")
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["launch", "--target", "eks", *O7], "--target eks needs --image"),
        (
            ["launch", "--target", "slurm", "cluster=trn1_1node", "cluster.nodes=4", "cluster.efa_devices=0"],
            "trn1 nodes talk to each other only over EFA",
        ),
        (
            ["launch", "--target", "slurm", "experiment=hlat_70b", "cluster=trn1_x4", "parallelism=hlat_70b"],
            "configuration error: world size 128 is not divisible by parallelism.tp=32 x parallelism.pp=8",
        ),
        (
            ["launch", "--target", "slurm", "cluster=trn1_x4", "modle=7b"],
            "configuration error: modle is not a config key; did you mean model=7b?",
        ),
        (["launch", "--target", "slurm", "cluster=trn1_x4", "train.steps=many"], "could not be converted to Integer"),
        (["launch", "--target", "slurm", "cluster=trn1_x99"], "cluster=trn1_x99: conf/cluster/ has no option"),
        (
            ["launch", "--target", "slurm", "experiment=hlat_7b", "optimizer.warmup_steps=500000"],
            "optimizer.warmup_steps=500000 is not below train.steps=450000",
        ),
        (["launch", "--target", "slurm", "--name", "HLAT_7b", *O7], "DNS-1035"),
        (
            ["launch", "--target", "slurm", "cluster=cpu", "cluster.cpus_per_task=0"],
            "cluster.cpus_per_task=0 must be >= 1 or null",
        ),
        (["compile", "cluster=gpu_8x", "train.micro_batch_size=1"], "cluster=gpu_8x uses backend torch"),
        (["compile", "--steps", "0", *O7], "--steps=0 must be >= 1"),
        (["launch", "--target", "slurm", "--port", "70000", *O7], "--port=70000 is not a TCP port"),
        (["compile", "--target", "slurm", "--run", *O7], "submit the script with sbatch"),
        (["compile", "--run", *SMALL_TRN], "neuron_parallel_compile is not on PATH"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    code, out, err = hlat(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("hlat: ") and message in err and "Traceback" not in err


@pytest.mark.usefixtures("fake_neuron_env")
def test_compile_run_executes_the_node_script(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--run on one node: neuron_parallel_compile gets the torchrun command, with the cache variable exported."""
    bin_dir, log = tmp_path / "bin", tmp_path / "argv.txt"
    bin_dir.mkdir()
    fake = bin_dir / "neuron_parallel_compile"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$NEURON_COMPILE_CACHE_URL" "$@" > {log}\nexit 3\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    stale = tmp_path / "outputs" / "job" / "compile" / "checkpoints"
    stale.mkdir(parents=True)  # a previous compile's directory: removed first (train.resume=never would refuse it)
    code, _, _ = hlat(
        capsys, "compile", "--run", "--name", "job", "--steps", "3", *SMALL_TRN, "cluster.compile_cache=/tmp/cc"
    )
    assert code == 3  # the wrapper's exit status
    assert log.read_text().splitlines() == [
        "/tmp/cc",
        os.path.abspath(sys.executable),
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "32",
        "--max-restarts",
        "0",
        str(ROOT / "train.py"),
        *SMALL_TRN,
        "cluster.compile_cache=/tmp/cc",
        f"tracker.uri=sqlite:///{tmp_path}/mlflow.db",
        "train.steps=3",
        "optimizer.warmup_steps=2",
        "train.resume=never",
        "tracker.kind=console",
        f"hydra.run.dir={tmp_path}/outputs/job/compile",
    ]
    assert not stale.exists()


def test_the_neuron_backends_variables_are_exported(capsys: pytest.CaptureFixture[str]) -> None:
    """Without the fake: every variable of hlat.backends.neuron.neuron_env reaches the script, quoted."""
    neuron_env = getattr(neuron, "neuron_env", None)
    if neuron_env is None:
        pytest.skip("hlat.backends.neuron.neuron_env is not there yet")
    code, out, _ = hlat(capsys, "launch", "--target", "slurm", *O7)
    env = neuron_env(to_run_config(compose_cfg(*O7)))
    assert code == 0 and env["XLA_USE_BF16"] == "1"  # HLAT-7B: BF16 with stochastic rounding
    exports = [line for line in out.splitlines() if line.startswith("export ") and "MASTER_ADDR" not in line]
    assert exports.pop(0) == f'export PATH={shlex.quote(str(Path(install().python).parent))}:"$PATH"'  # first
    elastic = [
        "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
        "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=30",
    ]  # torch elastic's, after the backend's
    assert exports == [f"export {k}={shlex.quote(v)}" for k, v in env.items()] + elastic


def test_the_scripts_run_train_py_from_the_checkout_or_an_images_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hlat.deploy import commands

    got = install()
    assert Path(got.root, "train.py").is_file() and os.access(got.python, os.X_OK)  # this checkout, pip -e
    monkeypatch.setattr(commands, "__file__", str(tmp_path / "site-packages" / "hlat" / "deploy" / "commands.py"))
    monkeypatch.chdir(tmp_path)  # a wheel install: no train.py beside the package
    with pytest.raises(commands.UsageError, match="nor in the working directory"):
        install()
    (tmp_path / "train.py").write_text("")  # an image's /opt/hlat
    assert install().root == str(tmp_path.resolve())
