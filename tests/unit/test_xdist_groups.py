"""The units of work of ``--dist loadgroup`` (tests/conftest.py's ``xdist_group``): a doc's README lane commands stay
together and in order on one worker, and the modules that share a costly module fixture are not split."""

from __future__ import annotations

from tests.conftest import SHARED_FIXTURE_MODULES, xdist_group
from tests.readme.commands import ROOT, Plan


def test_each_docs_commands_are_one_unit_of_work() -> None:
    plan = Plan.of()
    for command, _ in plan.items:
        assert xdist_group(f"tests/readme/test_readme.py::test_readme_command[{command.where}]") == command.file
    assert len({c.file for c, _ in plan.items}) > 2  # more than one unit: the files can run side by side


def test_modules_with_a_shared_fixture_are_one_unit_and_other_tests_their_own() -> None:
    for path in SHARED_FIXTURE_MODULES:
        assert (ROOT / path).is_file(), f"{path} is gone: update SHARED_FIXTURE_MODULES in tests/conftest.py"
        assert xdist_group(f"{path}::test_a") == xdist_group(f"{path}::test_b[x]") == path
    other = "tests/integration/test_health.py::test_a_stopped_rank_is_named_by_the_rank_that_waits_for_it[0]"
    assert xdist_group(other) == other
