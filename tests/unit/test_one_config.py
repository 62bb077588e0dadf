"""One config in: what the run logs of its config comes from the RunConfig alone, and fault injection is a hook."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from hlat.config import FaultConfig, flatten, to_run_config, to_yaml
from hlat.state import StepOutput, TrainState
from hlat.train.faults import fault_hooks
from tests.conftest import compose_cfg
from tests.unit.test_import_boundaries import import_graph


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("experiment=hlat_7b", "cluster=trn1_x64", "parallelism=hlat_7b"),
        ("eval=local", "eval.every_tokens=1024", "tracker.run_name=named"),
        ("fault=nonfinite", "precision=bf16_sr", "data=offline_packed"),
    ],
)
def test_the_logged_config_is_hydras_resolved_config(overrides: tuple[str, ...]) -> None:
    """Below the entry only the RunConfig exists: its params and config.yaml must be what Hydra composed."""
    hydra_cfg = compose_cfg(*overrides)
    cfg = to_run_config(hydra_cfg)
    assert to_yaml(cfg) == OmegaConf.to_yaml(hydra_cfg, resolve=True)
    assert flatten(dataclasses.asdict(cfg)) == flatten(OmegaConf.to_container(hydra_cfg, resolve=True))


def test_fault_injection_is_hooks_the_trainer_does_not_know(tmp_path: Path) -> None:
    off = fault_hooks(FaultConfig(), steps=10, markers=tmp_path, rank=0)
    assert (off.loop, off.grad, off.on_save) == ([], [], None)  # off: nothing to add
    on = fault_hooks(FaultConfig(name="nan", nonfinite_at=[2]), steps=10, markers=tmp_path, rank=0)
    assert len(on.loop) == 1 and on.on_save is not None
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    on.loop[0](TrainState(step=1), StepOutput(loss=torch.zeros(()), grad_norm=torch.zeros(()), lr=0.0, data_wait_s=0.0))
    for hook in on.grad:
        hook(2, model)
    assert torch.isnan(model.weight.grad).all()  # the grad hook poisons step 2, as fault.nonfinite_at says
    graph = import_graph()
    assert "hlat.train.faults" not in graph["hlat.train.trainer"]  # the trainer runs hooks, whatever they are
    assert "hlat.train.faults" in graph["hlat.train.hooks"]
