"""``hlat launch --target eks``: a Kubeflow PyTorchJob (training-operator ``kubeflow.org/v1``), dumped with PyYAML.

One Worker pod per node runs the node's torchrun; torch elastic owns the restarts (``elasticPolicy``), with the c10d
rendezvous on worker 0. Imports ``hlat.config``, ``hlat.deploy.render`` and ``hlat.launch.preempt``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from hlat.config import RunConfig
from hlat.deploy.render import RDZV_PORT, check_name, launch_env, layout, torchrun_argv
from hlat.launch.preempt import launcher_grace_s

NEURONCORES_PER_DEVICE = 2
"""NeuronCore-v2 per Trainium (v1) chip: the Neuron device plugin counts chips as ``aws.amazon.com/neuron``."""
CONTAINER = "pytorch"
"""The training operator finds the job's container and port by these names."""
PORT_NAME = "pytorchjob-port"
FSX_CLAIM = "fsx-claim"
FSX_MOUNT = "/fsx"


def resources(cfg: RunConfig) -> dict[str, int]:
    """Extended resources one worker pod needs: the node's accelerators, and its EFA interfaces for multi-node."""
    c = cfg.cluster
    out: dict[str, int] = {}
    if c.backend == "neuron":
        out["aws.amazon.com/neuron"] = max(c.devices_per_node // NEURONCORES_PER_DEVICE, 1)
    elif c.device == "cuda":
        out["nvidia.com/gpu"] = c.devices_per_node
    if c.efa_devices and c.nodes > 1:
        out["vpc.amazonaws.com/efa"] = c.efa_devices
    return out


def pytorchjob(
    cfg: RunConfig,
    overrides: Sequence[str],
    env: Mapping[str, str],
    *,
    name: str,
    image: str,
    port: int = RDZV_PORT,
    fsx_claim: str = FSX_CLAIM,
    fsx_mount: str = FSX_MOUNT,
) -> dict[str, Any]:
    """The PyTorchJob manifest of the run.

    Args:
        cfg: The validated run config.
        overrides: The Hydra overrides ``train.py`` gets, ``hydra.run.dir`` included (on the FSx volume).
        env: Variables to set in every worker container.
        name: Job name: ``metadata.name``, the rendezvous id and the prefix of the pod names.
        image: The container image: hlat's image, built from the repository's Dockerfile and pushed to a registry
            the cluster can pull from. Its working directory must hold ``train.py`` and ``conf/``.
        port: Rendezvous port on worker 0.
        fsx_claim: PersistentVolumeClaim of the FSx for Lustre file system.
        fsx_mount: Where the FSx volume is mounted in the container.

    Raises:
        ValueError: A name that is not a DNS-1035 label, or so long that its pod names pass 63 characters.
        ConfigError: A parallel layout that does not fit the cluster.
    """
    c = cfg.cluster
    _check_pod_names(name, c.nodes)
    labels = {"app.kubernetes.io/name": "hlat", "app.kubernetes.io/instance": name}
    container = _container(cfg, overrides, env, name=name, image=image, port=port, fsx_mount=fsx_mount)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "labels": labels, "annotations": {"hlat/layout": layout(cfg)}},
        "spec": {
            "nprocPerNode": str(c.nproc_per_node),
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "rdzvPort": port,
                "minReplicas": c.nodes,
                "maxReplicas": c.nodes,
                "maxRestarts": c.max_restarts,
            },
            "pytorchReplicaSpecs": {
                "Worker": {
                    "replicas": c.nodes,
                    "restartPolicy": "OnFailure",
                    "template": {"metadata": {"labels": dict(labels)}, "spec": _pod_spec(cfg, container, fsx_claim)},
                }
            },
        },
    }


def _check_pod_names(name: str, nodes: int) -> None:
    """Refuse a job name that is not a DNS-1035 label or whose last pod name passes Kubernetes' 63 characters."""
    check_name(name)
    pod = f"{name}-worker-{nodes - 1}"
    if len(pod) > 63:
        raise ValueError(
            f"job name {name!r} is too long: its pod name {pod!r} passes Kubernetes' 63 characters; pass a name of "
            f"at most {63 - len(pod) + len(name)} characters with --name"
        )


def _container(
    cfg: RunConfig,
    overrides: Sequence[str],
    env: Mapping[str, str],
    *,
    name: str,
    image: str,
    port: int,
    fsx_mount: str,
) -> dict[str, Any]:
    """The worker container: the node's torchrun, rendezvous on worker 0, all of the node's accelerators and EFA."""
    # Worker 0's host is the operator's default ``<job>-worker-0``; its Service exposes the pytorchjob-port port.
    command = torchrun_argv(cfg, overrides, endpoint=f"{name}-worker-0:{port}", rdzv_id=name)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image,
        "command": command,
        "env": [{"name": k, "value": str(v)} for k, v in launch_env(cfg, env).items()],
        "ports": [{"name": PORT_NAME, "containerPort": port}],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "fsx", "mountPath": fsx_mount}],
    }
    if need := resources(cfg):
        container["resources"] = {"requests": dict(need), "limits": dict(need)}
    return container


def _pod_spec(cfg: RunConfig, container: dict[str, Any], fsx_claim: str) -> dict[str, Any]:
    """The worker pod: the container, a memory-backed ``/dev/shm``, the shared FSx volume and the grace period."""
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {"name": "fsx", "persistentVolumeClaim": {"claimName": fsx_claim}},
        ],
        # On an eviction or a deleted job Kubernetes sends SIGTERM to torchrun, which forwards it: the trainers
        # checkpoint the step in flight (hlat.launch.preempt) before the kubelet's SIGKILL, grace + 10 s later.
        "terminationGracePeriodSeconds": launcher_grace_s(cfg.train.preempt_grace_s),
    }
    if cfg.cluster.instance_type:
        pod_spec["nodeSelector"] = {"node.kubernetes.io/instance-type": cfg.cluster.instance_type}
    return pod_spec


def to_yaml(manifest: Mapping[str, Any]) -> str:
    """Dump a manifest as block-style YAML, keys in the order they were built."""
    return yaml.safe_dump(dict(manifest), sort_keys=False, default_flow_style=False, width=1000)
