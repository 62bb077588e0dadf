"""The README's commands and the README lane's list of them (tests/readme/commands.py) cannot drift apart.

The lane itself (``make test-readme``) runs the commands; these checks are cheap and run in the main suite.
"""

from __future__ import annotations

import re

from tests.readme.commands import ACTIVATE, EXCEPTIONS, README, Command, Plan, commands, policy


def test_every_readme_command_has_a_policy() -> None:
    plan = Plan.of()  # raises LookupError naming the line of a command without one
    assert len(plan.items) >= 40
    ran = [c.text for c, p in plan.items if p.action != "skip"]
    assert len(ran) >= 0.8 * len(plan.items), "the lane must run most of the README, not skip it"


def test_every_exception_is_still_a_readme_command() -> None:
    texts = {c.text for c in commands()}
    stale = sorted(set(EXCEPTIONS) - texts)
    assert not stale, f"EXCEPTIONS lists commands that left the README: {stale}"


def test_the_readme_starts_with_its_two_commands_then_activation() -> None:
    first = [c.text for c in commands()[:3]]
    assert first == ["make demo", "make test", ACTIVATE]


def test_commands_are_runnable_as_written() -> None:
    """No placeholders to fill in and no venv paths: after activation the README's commands are verbatim."""
    for c in commands():
        assert not re.search(r"<[a-z][a-z _-]*>", c.text), f"README.md:{c.line}: a placeholder in `{c.text}`"
        assert ".venv/bin/" not in c.text or c.text == ACTIVATE, f"README.md:{c.line}: `{c.text}` (activate instead)"


def test_parsing_joins_continuations_and_drops_comments(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# T\n\n## Sec\n```bash\npython train.py a=1 \\\n    b=2   # two\n# only a comment\n"
                      "echo '#kept' # gone\n```\n```python\nnot = 'a command'\n```\n")  # fmt: skip
    assert commands(readme) == [Command("python train.py a=1 b=2", 5, "Sec"), Command("echo '#kept'", 8, "Sec")]


def test_training_commands_are_made_tiny_and_hlat_commands_run() -> None:
    assert policy(Command("python train.py model=small", 1, "")).action == "tiny"
    assert policy(Command("python train.py experiment=hlat_7b train.dry_run=true", 1, "")).action == "run"
    assert policy(Command("hlat plan", 1, "")).action == "run"
    assert README.is_file()


def _train_overrides(text: str) -> tuple[list[str], int | None] | None:
    """The Hydra overrides of a single-run training command and the world torchrun gives it (None: the config's)."""
    words = text.split()
    if words[:2] in (["python", "train.py"], [".venv-neuron/bin/python", "train.py"]):
        overrides, world = words[2:], None
    elif words[0] == "torchrun" and "train.py" in words:
        at = words.index("train.py")
        opts = dict(zip(words[1:at:2], words[2:at:2], strict=False))
        overrides, world = words[at + 1 :], int(opts.get("--nproc-per-node", 1)) * int(opts.get("--nnodes", 1))
    else:
        return None
    if any(w.startswith("-") or w.startswith("hydra.") for w in overrides):  # sweeps, Hydra flags: composed elsewhere
        return None
    return overrides, world


def test_every_readme_training_command_is_a_valid_config_and_layout() -> None:
    """Also the ones the lane cannot run (8 GPUs, trn1 clusters): composed and checked as the trainer would, up to
    the batch and rank layout, so a README command that a GPU box would refuse (a global batch not divisible by the
    micro-batch x 8 ranks) fails here."""
    from hlat.config import ConfigError, to_run_config
    from hlat.parallel import ParallelDims
    from tests.conftest import compose_cfg

    checked = 0
    for c in commands():
        found = _train_overrides(c.text)
        if found is None:
            continue
        overrides, world = found
        cfg = to_run_config(compose_cfg(*overrides))
        try:
            ParallelDims.build(cfg.parallelism, world or cfg.cluster.world_size, cfg.model, cfg.train)
        except ConfigError as e:
            raise AssertionError(f"README.md:{c.line}: `{c.text}`: {e}") from None
        checked += 1
    assert checked >= 20
