"""docs/container.md's podman commands, as written, on the image the lane built (the README lane skips them: it has
neither podman's configuration nor the image). Their folder commands run first, as the doc orders them; a training
gets small batches appended, as the README lane appends its tiny overrides (Hydra: the last value of a key wins)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.image.conftest import podman_env
from tests.readme.commands import DOCS, commands
from tests.timeouts import hang_guard

SMALL = ("train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=4", "cluster.num_threads=1")


def test_the_podman_commands_of_the_doc_train_onto_the_host_folders(images: dict[str, str], tmp_path: Path) -> None:
    from mlflow import MlflowClient

    doc = [c.text for c in commands(DOCS / "container.md")]
    runs = [c for c in doc if c.startswith(("mkdir ", "podman run "))]
    assert len([c for c in runs if c.startswith("podman run ")]) >= 1, doc
    for command in runs:
        if command.startswith("podman run "):
            command += " " + " ".join(SMALL)
        shell = ["bash", "-c", command]
        done = subprocess.run(
            shell, cwd=tmp_path, env=podman_env(), capture_output=True, text=True, timeout=hang_guard(900)
        )
        assert done.returncode == 0, f"{command}: {done.stderr[-4000:]}"
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("hlat").experiment_id])
    assert run.info.status == "FINISHED"
    assert any((tmp_path / "mlruns" / run.info.experiment_id / run.info.run_id / "artifacts").rglob("*"))
    assert any((tmp_path / "outputs").rglob("checkpoints/step_*"))
