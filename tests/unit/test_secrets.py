"""Provenance without secrets: a variable whose name looks like a credential's is recorded as ``<redacted>`` wherever
hlat writes the environment (``provenance.json`` and its MLflow artifact), and no launch file holds one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlat.cli import main as hlat_main
from hlat.config import to_run_config
from hlat.deploy.render import launch_env
from hlat.track.provenance import REDACTED, is_secret_name, redact_env, write_provenance
from tests.conftest import compose_cfg

CREDENTIALS = [
    *("NEURON_FAKE_TOKEN", "XLA_API_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"),
    *("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MLFLOW_TRACKING_PASSWORD", "NEURON_DB_PASSWD", "NEURON_DB_PASS"),
    *("NEURON_DB_PWD", "NEURON_CLIENT_SECRET", "NEURON_CLIENTSECRET", "NEURON_GITHUBTOKEN", "NEURON_APIKEY"),
    *("xla_private_key", "Neuron_Auth", "NEURON_OAUTH_CLIENT", "XLA_AUTHORIZATION", "XLA_COOKIE", "BW_SESSION"),
    *("NEURON_ACCESSKEY", "GOOGLE_APPLICATION_CREDENTIALS", "NEURON_CREDS", "NEURON_SSH_KEYS"),
    *("NEURON_SIGNING_PASSPHRASE", "NEURON-CACHE.TOKEN", "XLA_SECRETS_JSON", "NEURON_CREDENTIAL_1"),
]
"""Credentials' names: whole name parts (``KEY`` in ``AWS_ACCESS_KEY_ID``), endings of a part (``GITHUBTOKEN``), any
case and separator."""
KNOBS = [
    # What hlat exports itself (hlat.backends.neuron_plan.neuron_env, hlat.deploy.render.launch_env).
    *("NEURON_CC_FLAGS", "NEURON_COMPILE_CACHE_URL", "NEURON_FUSE_SOFTMAX"),
    *("NEURON_RT_ASYNC_EXEC_MAX_INFLIGHT_REQUESTS", "NEURON_RT_STOCHASTIC_ROUNDING_EN"),
    *("NEURON_RT_STOCHASTIC_ROUNDING_SEED", "XLA_USE_BF16", "XLA_DOWNCAST_BF16"),
    *("XLA_DISABLE_FUNCTIONALIZATION", "MALLOC_ARENA_MAX", "PJRT_DEVICE", "NXD_CPU_MODE", "FI_PROVIDER"),
    *("FI_EFA_USE_DEVICE_RDMA", "FI_EFA_FORK_SAFE", "PET_SIGNALS_TO_HANDLE", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"),
    # The Neuron SDK's documented knobs (runtime, compiler, torch-neuronx, NxD) and torch-xla's.
    *("NEURON_RT_VISIBLE_CORES", "NEURON_RT_NUM_CORES", "NEURON_RT_LOG_LEVEL", "NEURON_RT_LOG_LOCATION"),
    *("NEURON_RT_EXEC_TIMEOUT", "NEURON_RT_VALIDATE_HASH", "NEURON_RT_ROOT_COMM_ID"),
    *("NEURON_RT_VIRTUAL_CORE_SIZE", "NEURON_RT_INSPECT_ENABLE", "NEURON_RT_INSPECT_OUTPUT_DIR"),
    *("NEURON_RT_RESET_CORES", "NEURON_RT_S3_CORE_DUMP_PREFIX", "NEURON_RT_ASYNC_SENDRECV_BOOTSTRAP_PORT"),
    *("NEURON_RT_DBG_DUMP_INPUTS_ON_ERR", "NEURON_RT_ONE_THREAD_PER_CORE"),
    *("NEURON_RT_NUMERICAL_ERRORS_VERBOSITY", "NEURON_FRAMEWORK_DEBUG", "NEURON_EXTRACT_GRAPHS_ONLY"),
    *("NEURON_PARALLEL_COMPILE_MAX_RETRIES", "NEURON_NUM_RECENT_MODELS_TO_KEEP", "NEURON_LOGICAL_NC_CONFIG"),
    *("NEURON_TRANSFER_WITH_STATIC_RING_OPS", "NEURON_DUMP_HLO_SNAPSHOT", "NEURON_USE_EAGER_DEBUG_MODE"),
    *("NEURON_PJRT_PROCESS_INDEX", "NEURON_PJRT_PROCESSES_NUM_DEVICES", "NEURON_LIBTORCH_REMOTE_CACHE"),
    *("NEURON_COMPILED_ARTIFACTS", "NEURON_PLATFORM_TARGET_OVERRIDE", "NEURON_SEND_IP", "NEURON_PROCESS_TAG"),
    *("NEURON_FSDP_CC_MULTISTREAM", "NEURON_FAIL_ON_NAN", "NEURON_CONTEXT_LENGTH_BUCKETS"),
    *("NEURON_TOKEN_GEN_BUCKETS", "XLA_IR_DEBUG", "XLA_HLO_DEBUG", "XLA_FLAGS", "XLA_SAVE_TENSORS_FILE"),
    *("XLA_SAVE_TENSORS_FMT", "XLA_METRICS_FILE", "XLA_USE_32BIT_LONG", "XLA_ENABLE_PARAM_ALIASING"),
    *("XLA_TRANSFER_SEED_ASYNC", "XLA_USE_DUMMY_STORE"),
    # Near misses: a credential word inside a harmless one.
    *("NEURON_MONKEY", "XLA_BYPASS", "NEURON_KEYBOARD", "NEURON_TOKENIZER_PATH", "NEURON_MAX_TOKENS"),
    *("NEURON_AUTHOR", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"),
]
"""Names that are not credentials and must keep their values in the record."""
O7 = ["experiment=hlat_7b", "cluster=trn1_x64", "parallelism=hlat_7b"]


def planted(prefix: str) -> dict[str, str]:
    """A credential of each prefix, with a value found nowhere else."""
    return {f"{prefix}FAKE_TOKEN": f"hlat-secret-{prefix.lower()}token", f"{prefix}API_KEY": f"hlat-secret-{prefix}key"}


SECRET_ENV = {
    **planted("NEURON_"),
    **planted("XLA_"),
    "HF_TOKEN": "hlat-secret-hf",
    "AWS_SECRET_ACCESS_KEY": "hlat-secret-aws",
}
KNOB_ENV = {"NEURON_RT_VISIBLE_CORES": "0-1", "XLA_IR_DEBUG": "1", "NEURON_TOKEN_GEN_BUCKETS": "128,512"}
URL = ("NEURON_COMPILE_CACHE_URL", "https://hlat:hlat-secret-pw@cache.example/neuron")
"""A harmless name whose value holds a password: recorded as https://<redacted>@cache.example/neuron."""


def secrets_in(paths: list[Path]) -> list[str]:
    """``path: value`` for every planted secret value found in any of the files (bytes, so databases too)."""
    values = [*SECRET_ENV.values(), "hlat-secret-pw"]
    return [f"{p}: {v}" for p in paths if p.is_file() for v in values if v.encode() in p.read_bytes()]


def test_credential_names_are_recognised_and_knobs_are_not() -> None:
    assert [n for n in CREDENTIALS if not is_secret_name(n)] == []
    assert [n for n in KNOBS if is_secret_name(n)] == []


def test_redact_env_keeps_every_name_and_hides_credentials_and_url_passwords() -> None:
    env = {
        "XLA_API_KEY": "k",
        "NEURON_RT_VISIBLE_CORES": "0-1",
        URL[0]: URL[1],
        "XLA_FLAGS": "--to=s3://b/x",
        "X": "ssh://hlat-token@git.example/repo and http://a:b@c",
    }
    assert redact_env(env) == {
        "XLA_API_KEY": REDACTED,
        "NEURON_RT_VISIBLE_CORES": "0-1",
        URL[0]: "https://<redacted>@cache.example/neuron",
        "XLA_FLAGS": "--to=s3://b/x",  # no user information: unchanged
        "X": "ssh://<redacted>@git.example/repo and http://<redacted>@c",
    }


def test_provenance_records_credentials_as_redacted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in {**SECRET_ENV, **KNOB_ENV, URL[0]: URL[1]}.items():
        monkeypatch.setenv(k, v)
    _, files = write_provenance(tmp_path, "model:\n  dim: 64\n")
    env = json.loads((tmp_path / "provenance.json").read_text())["env"]
    recorded = {k: env.get(k) for k in SECRET_ENV if k.startswith(("NEURON_", "XLA_"))}
    assert len(recorded) == 4 and recorded == dict.fromkeys(recorded, REDACTED)  # the user sees that they were set
    assert {k: env[k] for k in KNOB_ENV} == KNOB_ENV
    assert env[URL[0]] == "https://<redacted>@cache.example/neuron"
    assert "HF_TOKEN" not in env  # only NEURON_* and XLA_* are recorded at all
    assert secrets_in(list(tmp_path.rglob("*"))) == [] and set(files) <= set(tmp_path.iterdir())


def test_launch_files_hold_no_credential_of_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``hlat launch`` (all three targets) and ``hlat compile`` with credentials in the environment: none of them
    reaches a file; the job gets them from the environment it starts in."""
    for k, v in SECRET_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(tmp_path)
    for argv in (
        ["launch", "--target", "torchrun"],
        ["launch", "--target", "slurm"],
        ["launch", "--target", "eks", "--image", "reg/hlat:1"],
        ["compile", "--target", "slurm"],
    ):
        with pytest.raises(SystemExit) as exit_:
            hlat_main([*argv, "--out", str(tmp_path / "out"), *O7])
        assert exit_.value.code == 0, capsys.readouterr().err
    written = list((tmp_path / "out").iterdir())
    assert len(written) == 4 and secrets_in(written) == []
    assert "export NEURON_CC_FLAGS=" in next(p for p in written if p.suffix == ".sbatch").read_text()  # it exports


def test_launch_env_refuses_a_credential_by_name() -> None:
    cfg = to_run_config(compose_cfg(*O7))
    with pytest.raises(ValueError, match=r"\['NEURON_FAKE_TOKEN'\] look like credentials.*Kubernetes Secret"):
        launch_env(cfg, {"NEURON_FUSE_SOFTMAX": "1", "NEURON_FAKE_TOKEN": "x"})


@pytest.mark.slow
def test_a_run_writes_no_credential_of_the_environment_anywhere(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python train.py`` with credentials of every prefix in its environment: none of their values is in any file of
    the run directory (provenance, config, logs, checkpoints), the MLflow store (the sqlite database and the
    artifacts) or the output; their names are recorded as redacted and the knobs with their values."""
    from tests.integration.test_train import cli
    from tests.unit.test_bad_input import TINY

    for k, v in {**SECRET_ENV, **KNOB_ENV, URL[0]: URL[1]}.items():
        monkeypatch.setenv(k, v)
    r = cli(*TINY, f"data.cache_dir={cache_dir}", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert secrets_in(list(tmp_path.rglob("*"))) == []
    assert [v for v in SECRET_ENV.values() if v in r.stdout + r.stderr] == []
    artifact = next(tmp_path.glob("mlruns/*/*/artifacts/provenance.json"))  # the MLflow store beside mlflow.db
    assert artifact.read_bytes() == (tmp_path / "run" / "provenance.json").read_bytes()
    env = json.loads(artifact.read_text())["env"]
    assert env["NEURON_FAKE_TOKEN"] == env["XLA_API_KEY"] == REDACTED and "HF_TOKEN" not in env
    assert {k: env[k] for k in KNOB_ENV} == KNOB_ENV and env[URL[0]] == "https://<redacted>@cache.example/neuron"
    assert (tmp_path / "mlflow.db").is_file() and (tmp_path / "run" / "train.log").is_file()  # both were searched
