"""Every config key is classified for the graph planner (``hlat.plan.graph_keys``), and no stale key is kept."""

from __future__ import annotations

from hlat.config import RunConfig
from hlat.plan.graph_keys import CLASSES, KEYS, leaves


def test_every_config_key_says_how_it_acts_on_the_graphs() -> None:
    """A new config field fails here until ``KEYS`` gives it a class (shape, traced, host, env) and a mechanism:
    the planner cannot group sweep arms over a key it does not know how to compare."""
    fields = set(leaves(RunConfig))
    missing = sorted(fields - set(KEYS))
    assert not missing, f"classify these config keys in hlat/plan/graph_keys.py (KEYS): {missing}"
    stale = sorted(set(KEYS) - fields)
    assert not stale, f"hlat/plan/graph_keys.py classifies keys that no longer exist: {stale}"
    assert all(cls in CLASSES and mechanism for cls, mechanism in KEYS.values())


def test_hlat_graphs_keys_prints_every_key_and_plan_says_where_it_runs(capsys) -> None:
    """``hlat graphs keys`` lists every key with its class; ``hlat graphs plan`` outside the NxD lane's environment
    (this one has no torch-xla) refuses in one line saying where to run it, before composing anything."""
    import importlib.util

    from hlat.plan.graphs_command import main

    assert main(["keys"]) == 0
    out = capsys.readouterr().out
    assert all(key in out for key in KEYS) and "optimizer.beta2" in out and " traced " in out
    if importlib.util.find_spec("torch_xla") is None:
        assert main(["plan", "optimizer.beta2=0.95"]) == 2
        assert ".venv-neuron/bin/hlat graphs plan" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
