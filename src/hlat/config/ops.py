"""Schemas of where a run executes and how it is watched: cluster, tracker, and fault injection."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hlat.config.base import _check, _check_choice, _check_range, _Frozen, show


@dataclass
class ClusterConfig(_Frozen):
    """Where the run executes (``conf/cluster/``): the ONLY place that chooses the backend."""

    name: str = "cpu"
    """Preset name."""
    backend: str = "torch"
    """Trainer backend: torch (CPU/CUDA) or neuron (trn1, neuronx-distributed)."""
    device: str = "cpu"
    """Device type for the torch backend: cpu or cuda."""
    num_threads: int | None = None
    """torch intra-op threads on CPU; null keeps torch's default (one per core)."""
    memory_fraction: float = 0.9
    """Share of the device's free memory a run may plan to use; the pre-flight check refuses more."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s of ONE device at the compute dtype (the MFU denominator); null: a published figure by the
    CUDA device's name, or this CPU's measured, cached matmul peak."""
    devices_per_node: int = 1
    """Devices (GPUs, NeuronCores, CPU sockets counted as one) per node, for the cost per node-hour."""
    device_memory_gib: float | None = None
    """Memory of ONE device in GiB (16 per trn1 NeuronCore), the budget a dry run plans against off that hardware;
    null: the memory this host reports."""
    price_per_hour: float | None = None
    """Price of one node per hour (USD) for the cost per 4M tokens (CPT); null: no cost metric."""
    nproc_per_node: int = 1
    """Trainer processes on this node, started by ``python train.py`` through torch elastic (an external
    ``torchrun``'s ``--nproc-per-node`` decides instead)."""
    nodes: int = 1
    """Hosts in the job (world size ``nodes x nproc_per_node``); several nodes are started by what ``hlat launch``
    renders."""
    cpus_per_task: int | None = None
    """CPUs of one node under Slurm (``--cpus-per-task``): 128 on trn1.32xlarge; null: every CPU Slurm allocates on
    the node."""
    instance_type: str | None = None
    """Cloud instance type of a node (``trn1.32xlarge``), for the Kubernetes node selector and the docs."""
    efa_devices: int = 0
    """EFA network interfaces per node (8 on trn1.32xlarge, 16 on trn1n); > 0 turns on the EFA variables and
    resource for multi-node runs."""
    compile_cache: str = "/var/tmp/neuron-compile-cache"
    """Neuron compile cache, on local disk: a shared FSx cache caused timeouts in HLAT (arXiv 2404.10630 §4.3)."""
    pjrt_device: str = "NEURON"
    """torch-xla's runtime device (``PJRT_DEVICE``): ``NEURON`` on trn1, ``CPU`` for the real NxD without Trainium
    (``cluster=xla_cpu``)."""
    nxd_cpu_mode: bool = False
    """NxD's own CPU mode (``NXD_CPU_MODE=1``, ``cluster=nxd_cpu``): NxD's TP and PP across processes over gloo,
    which torch-xla's CPU device cannot do. Needs the neuron backend and ``pjrt_device: CPU``."""
    max_restarts: int = 0
    """Restarts after a failure under torch elastic, each resuming from the newest valid checkpoint; 0: no
    supervision, the trainer runs in the launching process."""
    intra_node_gb_s: float | None = None
    """Bandwidth of ONE device to the rest of its node, GB/s per direction, for ``hlat plan``; null: no model."""
    inter_node_gbit_s: float | None = None
    """Network bandwidth of ONE node to the others, Gbit/s per direction (EFA: 800 on trn1.32xlarge), for
    ``hlat plan``; null: no model."""
    memory_gb_s: float | None = None
    """HBM bandwidth of ONE device, GB/s: the (memory-bound) optimizer step of ``hlat plan``. null: no model."""
    compute_efficiency: float | None = None
    """In (0, 1]: the calibrated fraction of ``peak_tflops`` a step's FLOPs achieve, communication aside
    (docs/planner.md); null: no step-time model."""
    intra_node_efficiency: float = 1.0
    """In (0, 1]: achieved fraction of ``intra_node_gb_s`` in large ring collectives (bus bandwidth)."""
    inter_node_efficiency: float = 1.0
    """In (0, 1]: achieved fraction of ``inter_node_gbit_s`` in collectives across nodes, at the job's scale."""
    grad_reduce_overlap: float = 0.0
    """In [0, 1]: fraction of the gradient reduction hidden behind the backward pass (0: after the last micro-batch,
    as NxD does)."""

    @property
    def world_size(self) -> int:
        """Ranks in the whole job: ``nodes x nproc_per_node``."""
        return self.nodes * self.nproc_per_node

    def __post_init__(self) -> None:
        _check_choice("cluster.backend", self.backend, ("torch", "neuron"))
        _check_choice("cluster.device", self.device, ("cpu", "cuda"))
        _check_choice("cluster.pjrt_device", self.pjrt_device, ("NEURON", "CPU"))
        _check(
            not self.nxd_cpu_mode or (self.backend == "neuron" and self.pjrt_device == "CPU"),
            f"cluster.nxd_cpu_mode=true runs NxD on CPU tensors: it needs cluster.backend=neuron and "
            f"cluster.pjrt_device=CPU (got {self.backend}, {self.pjrt_device}); use cluster=nxd_cpu",
        )
        _check_range(self, "cluster.num_threads", ">= 1", null="torch's default", example=8)
        _check_range(self, "cluster.memory_fraction", "(0, 1]")
        _check_range(self, "cluster.peak_tflops", "> 0", null="looked up or measured")
        _check_range(self, "cluster.devices_per_node", ">= 1")
        _check_range(self, "cluster.price_per_hour", ">= 0", null="no cost metric")
        _check_range(self, "cluster.nproc_per_node", ">= 1")
        _check_range(self, "cluster.device_memory_gib", "> 0", null="this host's memory", example=16)
        _check_range(self, "cluster.nodes", ">= 1")
        _check_range(self, "cluster.cpus_per_task", ">= 1", null="every CPU of the node", example=128)
        _check_range(self, "cluster.efa_devices", ">= 0", note="(0: no EFA)")
        _check_range(self, "cluster.max_restarts", ">= 0", note="(0: no supervision)")
        for key in ("intra_node_gb_s", "inter_node_gbit_s", "memory_gb_s"):
            _check_range(self, f"cluster.{key}", "> 0", null="no step-time model")
        _check_range(
            self, "cluster.compute_efficiency", "(0, 1]", null="no step-time model", note="(an achieved fraction)"
        )
        for key in ("intra_node_efficiency", "inter_node_efficiency"):
            _check_range(self, f"cluster.{key}", "(0, 1]", note="(an achieved fraction)")
        _check_range(self, "cluster.grad_reduce_overlap", "[0, 1]")
        self._freeze()


USERINFO = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*)://([^/?#\s]*)@")
"""A URL's ``scheme://userinfo@`` (greedy to the last ``@`` of the authority: a password may hold one)."""


def secret_userinfo(scheme: str, userinfo: str) -> bool:
    """Whether a URL's user information is a secret.

    Any is for ``http(s)`` (a user name alone may be a token); for other schemes the ``user:password`` form is
    (``postgresql://mlflow@...`` only names a role).
    """
    return scheme.lower() in ("http", "https") or ":" in userinfo


def holds_credentials(uri: str | None) -> bool:
    """Whether ``uri`` holds a URL whose user information is a secret (:func:`secret_userinfo`)."""
    return bool(uri) and any(secret_userinfo(m[1], m[2]) for m in USERINFO.finditer(uri))


@dataclass
class TrackerConfig(_Frozen):
    """Experiment tracking (``conf/tracker/``)."""

    name: str = "mlflow"
    """Preset name."""
    kind: str = "mlflow"
    """mlflow (plus the console progress bar) or console only."""
    uri: str | None = None
    """MLflow tracking URI; null means a sqlite store ``mlflow.db`` in the working directory."""
    experiment: str = "hlat"
    """MLflow experiment name."""
    run_name: str | None = None
    """MLflow run name; null derives one from the model and precision presets."""
    flush_every_s: float = 5.0
    """Metrics are buffered and sent in one batch at most this often (and at the end)."""
    spike_window: int = 20
    """Gradient spikes (arXiv 2404.10630 §4.1): steps in the running mean r of the gradient norm."""
    spike_threshold: float = 0.1
    """A spike starts when the gradient norm exceeds r + spike_threshold and lasts while it stays above."""
    spike_summary_every: int = 1000
    """Log the spike summary every this many steps (0: only at the end)."""
    plots: bool = True
    """At the end of a run, plot the curves and spikes into ``<run dir>/plots/`` and log them as artifacts."""
    layer_grad_norms_every: int = 0
    """Every this many steps, log the gradient norm of each layer (``grad_norm/layers.<i>``, ...); 0: off, no cost."""
    system_metrics: bool = True
    """MLflow's own system metrics (means of 30-s samples, every 5 min), from the first logged loss on (so the UI's
    compare view defaults to the loss)."""
    skip_finished: bool = True
    """In a multirun, skip a job whose config already FINISHED here and continue one that died; false reruns all."""

    def __post_init__(self) -> None:
        _check_choice("tracker.kind", self.kind, ("mlflow", "console"))
        # The entry points take a URI's user name and password off (hlat.track.credentials) before anything records
        # the config; one that reaches here came another way and would be written down with the run.
        _check(
            not holds_credentials(self.uri),
            "tracker.uri holds a password, which would be recorded with the run's config; give the URI without it "
            "and the credentials in the environment: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD for a "
            "tracking server, PGPASSWORD for PostgreSQL",
        )
        _check_range(self, "tracker.flush_every_s", ">= 0", note="(seconds; 0: send at once)")
        _check_range(self, "tracker.spike_window", ">= 1")
        _check_range(self, "tracker.spike_threshold", ">= 0")
        _check_range(self, "tracker.layer_grad_norms_every", ">= 0", note="(0: off)")
        _check_range(self, "tracker.spike_summary_every", ">= 0", note="(0: only at the end)")
        self._freeze()


@dataclass
class FaultConfig(_Frozen):
    """Fault injection for tests and demos (``conf/fault/``); each fault fires once per job (a marker records it)."""

    name: str = "none"
    """Preset name."""
    kill_at: list[int] = field(default_factory=list)
    """SIGKILL the trainer right after these optimizer steps."""
    kill_random: int = 0
    """Also SIGKILL it after this many distinct steps drawn at random (by ``seed``) from [1, train.steps)."""
    seed: int = 0
    """Seed of the random kill steps."""
    crash_in_save_at: int | None = None
    """SIGKILL the trainer while it writes the checkpoint of this step (its files written, the manifest not)."""
    corrupt_at: int | None = None
    """Once the checkpoint of this step is complete, flip one byte in its largest file, then SIGKILL the trainer."""
    disk_full_at: int | None = None
    """Writing the checkpoint of this step fails with ENOSPC (no space left on device) halfway through."""
    nonfinite_at: list[int] = field(default_factory=list)
    """Poison the gradients of these steps with NaN (exercises ``train.on_nonfinite``)."""
    hang_at: int | None = None
    """After this step, rank ``hang_rank`` enters an all-reduce no other rank joins (exercises the hang watchdog)."""
    sigstop_at: int | None = None
    """After this step, rank ``hang_rank`` SIGSTOPs itself, as a frozen host would; the others' watchdogs must name
    it."""
    hang_rank: int = 1
    """The rank that hangs at ``hang_at`` or stops at ``sigstop_at`` (a rank of the job: 0 in a one-process run)."""
    graph_at: int | None = None
    """At this step rank ``graph_rank`` alone traces one extra op into its update (a new graph only it compiles:
    what the graph divergence guard must catch); numerically a no-op."""
    graph_rank: int = 1
    """The rank that traces the extra graph at ``graph_at``."""
    min_step_s: float = 0.0
    """Every step lasts at least this many seconds, so a test signalling a running job cannot lose the race to a
    fast machine (0: off)."""

    def __post_init__(self) -> None:
        for key in ("kill_at", "nonfinite_at"):
            steps = list(getattr(self, key))
            _check(
                all(s >= 1 for s in steps),
                f"fault.{key}={show(steps)} holds a step below 1: steps count from 1 (the first optimizer step); "
                f"keep the steps >= 1, e.g. fault.{key}={show([s for s in steps if s >= 1] or [1])}",
            )
        for key in ("crash_in_save_at", "corrupt_at", "disk_full_at", "hang_at", "sigstop_at", "graph_at"):
            _check_range(self, f"fault.{key}", ">= 1", null="no such fault", example=1)
        _check_range(self, "fault.hang_rank", ">= 0", note="(a rank of the job)")
        _check_range(self, "fault.graph_rank", ">= 0", note="(a rank of the job)")
        _check_range(self, "fault.kill_random", ">= 0", note="(0: no random kills)")
        _check_range(self, "fault.min_step_s", ">= 0", note="(seconds; 0: off)", example=0.1)
        self._freeze()

    @property
    def active(self) -> bool:
        """Whether anything is injected."""
        return bool(self.kill_at or self.kill_random or self.nonfinite_at or self.min_step_s) or any(
            s is not None
            for s in (
                self.crash_in_save_at,
                self.corrupt_at,
                self.disk_full_at,
                self.hang_at,
                self.sigstop_at,
                self.graph_at,
            )
        )


@dataclass
class EvalTask(_Frozen):
    """One lm-evaluation-harness task (or group) and its number of in-context examples."""

    task: str = ""
    """lm-eval task or group name (``mmlu``, ``arc_easy``, hlat's offline ``hlat_local``...)."""
    num_fewshot: int = 0
    """Shots, as the paper used them (arXiv 2404.10630 §5, Table 3)."""

    def __post_init__(self) -> None:
        _check(bool(self.task), "eval.tasks entries need a task name (e.g. {task: arc_easy, num_fewshot: 0})")
        _check(self.num_fewshot >= 0, f"eval task {self.task}: num_fewshot={self.num_fewshot} must be >= 0")


@dataclass
class EvalConfig(_Frozen):
    """Evaluation with lm-evaluation-harness (``conf/eval/``): after training with ``hlat eval``, or along it."""

    name: str = "none"
    """Preset name: none, local (offline tasks shipped with hlat), hlat_suite, truthfulness."""
    tasks: list[EvalTask] = field(default_factory=list)
    """Tasks and shots."""
    checkpoint: str | None = None
    """``hlat eval``: a checkpoint directory, or a run's checkpoint root (its newest valid checkpoint)."""
    all_checkpoints: bool = False
    """``hlat eval`` on a checkpoint root: evaluate every valid checkpoint, each metric against tokens seen (the
    paper's Fig. 3)."""
    every_tokens: int = 0
    """During training: evaluate at the first checkpoint after every this many training tokens (0: never)."""
    limit: int | None = None
    """Documents per task (lm-eval's ``limit``), for smoke tests only; null: all."""
    batch_size: int = 8
    """Sequences per forward pass."""
    device: str | None = None
    """cpu or cuda; null: the training cluster's device (cuda when the run trained on cuda and one is present)."""
    on_error: str = "fail"
    """An evaluation along training that fails: ``fail`` the run once training is done (exit 1), or ``warn``."""

    def __post_init__(self) -> None:
        _check_choice("eval.on_error", self.on_error, ("fail", "warn"))
        _check(self.every_tokens >= 0, f"eval.every_tokens={self.every_tokens} must be >= 0 (0: off)")
        _check(self.limit is None or self.limit > 0, f"eval.limit={self.limit} must be > 0 or null")
        _check(self.batch_size > 0, f"eval.batch_size={self.batch_size} must be > 0")
        _check(self.device in (None, "cpu", "cuda"), f"eval.device={self.device!r} must be cpu, cuda or null")
        _check(
            not self.every_tokens or bool(self.tasks),
            f"eval.every_tokens={self.every_tokens} but eval={self.name} has no tasks; choose eval=local, hlat_suite "
            "or truthfulness",
        )
