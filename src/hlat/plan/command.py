"""``hlat plan``: the command line of the planner (``hlat.plan.report``) and of its validation (``hlat.plan.paper``).

``hlat plan [overrides] [--nodes 4,8,16,32,64] [--json] [--paper]`` (docs/planner.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from hlat.config import ConfigError
from hlat.plan import report
from hlat.plan.report import format_plan, format_scaling, make_plan, plan_dict, scaling_rows


def node_counts(text: str) -> list[int]:
    """``--nodes``: comma-separated positive integers (``4,8,16``); argparse names the option on an error."""
    try:
        counts = [int(n) for n in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers (node counts, e.g. --nodes 4,8,16), got {text!r}"
        )
    return counts


def main(argv: list[str]) -> int:
    """Entry point of ``hlat plan``."""
    parser = argparse.ArgumentParser(prog="hlat plan", description=report.__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python train.py")
    parser.add_argument(
        "--nodes", type=node_counts, help="comma-separated node counts: a scaling table (e.g. 4,8,16,32,64)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    parser.add_argument("--paper", action="store_true", help="the validation against the HLAT paper and the SDK")
    args = parser.parse_args(argv)
    from hlat.config.compose import compose_run_config

    try:
        if args.paper:
            from hlat.plan.paper import validation_report

            print(validation_report())
            return 0
        cfg = compose_run_config(args.overrides)
        if args.nodes:
            rows = scaling_rows(cfg, args.nodes)
            print(json.dumps(rows, indent=2) if args.json else format_scaling(rows))
            return 0
        plan = make_plan(cfg, adapt=True)
        print(json.dumps(plan_dict(plan), indent=2) if args.json else format_plan(plan))
    except (ConfigError, ValueError) as e:
        print(f"hlat plan: {e}", file=sys.stderr)
        return 2
    return 0
