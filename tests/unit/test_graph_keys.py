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
