"""The clusters the planner's advice may propose: the presets of ``conf/cluster/``, and whether a cluster can grow.

Imports ``hlat.config`` only (PyYAML to read the presets).
"""

from __future__ import annotations

from typing import Any

from hlat.config import ClusterConfig, ConfigError


def can_add_nodes(cluster: ClusterConfig) -> bool:
    """Whether the advice may add nodes to ``cluster``.

    A preset of a cloud node type (``cluster.instance_type``: trn1, p4d, p5) or one that already spans nodes can
    grow; a preset of this machine (``cluster=cpu``, ``cpu_x2``, ``gpu_8x``, ``xla_cpu``) is one host. trn1 nodes talk
    only over EFA, so a neuron cluster without ``cluster.efa_devices`` stays on one node (``hlat launch`` refuses it).
    """
    if cluster.backend == "neuron" and cluster.efa_devices == 0:
        return False
    return cluster.nodes > 1 or cluster.instance_type is not None


def cluster_presets() -> list[ClusterConfig]:
    """Every preset of ``conf/cluster/``, its ``defaults`` parents merged in (what ``cluster=<name>`` composes)."""
    import yaml

    from hlat.config.compose import config_dir

    root = config_dir() / "cluster"

    def load(name: str) -> dict[str, Any]:
        data = yaml.safe_load((root / f"{name}.yaml").read_text()) or {}
        merged: dict[str, Any] = {}
        for parent in data.pop("defaults", []):
            merged |= {} if parent == "_self_" else load(parent)
        return merged | data

    presets = []
    for f in sorted(root.glob("*.yaml")):
        try:
            presets.append(ClusterConfig(**load(f.stem)))
        except (ConfigError, TypeError, OSError, yaml.YAMLError):
            continue  # not a plain preset (an interpolation, an unknown key): Hydra composes it, the advice skips it
    return presets
