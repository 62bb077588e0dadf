"""The commands of the README and the docs, and the README lane's list of them (tests/readme/commands.py), cannot
drift apart; the docs' links lead somewhere.

The lane itself (``make test-readme``) runs the commands; these checks are cheap and run in the main suite.
"""

from __future__ import annotations

import re

from tests.readme.commands import (
    ACTIVATE,
    EXCEPTIONS,
    RAN_BEFORE,
    README,
    ROOT,
    Command,
    Plan,
    all_commands,
    commands,
    policy,
    sources,
)


def test_every_readme_command_has_a_policy() -> None:
    plan = Plan.of()  # raises LookupError naming the line of a command without one
    assert len(plan.items) >= 70
    readme = [p for c, p in plan.items if c.file == "README.md"]
    assert sum(p.action != "skip" for p in readme) >= 0.8 * len(readme), "the lane must run most of the README"
    # The docs name more of what this machine lacks (the other lanes, Docker, Kubernetes, trn1): a quarter at most.
    # A command an earlier file runs as written counts as run: the lane runs it once.
    ran = [c.text for c, p in plan.items if p.action != "skip" or p.why.startswith(RAN_BEFORE)]
    assert len(ran) >= 0.75 * len(plan.items), "the lane must run most of the docs, not skip them"


def test_a_command_an_earlier_file_runs_as_written_runs_once(tmp_path) -> None:
    plan = Plan.of()
    where = {c.where: (c, p) for c, p in plan.items}
    sweep = next(c.where for c in commands() if "--config-name scaled_init" in c.text)
    assert where["docs/sweeps.md:7"][1].why == f"{RAN_BEFORE}{sweep}"  # the same ablation as the README's
    launch = next(c.where for c in commands(ROOT / "docs/trn1.md") if c.text.startswith("hlat launch --target slurm"))
    assert where[launch][1].why == f"{RAN_BEFORE}docs/deploy.md:9"
    # ...but not a repeat whose run a later command of its own file reads: each file runs in a checkout of its own.
    trained = next(c.where for c in commands(ROOT / "docs/evaluation.md") if "hydra.run.dir=outputs/myrun" in c.text)
    assert where[trained][1].action == "tiny", "docs/evaluation.md evaluates the run it trains"
    a, b = tmp_path / "a.md", tmp_path / "b.md"
    a.write_text("```bash\npython train.py hydra.run.dir=out/r\n```\n")
    b.write_text("```bash\npython train.py hydra.run.dir=out/r\nhlat summary out/r\n```\n")
    assert [p.action for _, p in Plan.of([a, b]).items] == ["tiny", "tiny", "run"]
    b.write_text("```bash\npython train.py hydra.run.dir=out/r\nhlat summary elsewhere\n```\n")
    assert [p.action for _, p in Plan.of([a, b]).items] == ["tiny", "skip", "run"]
    own = tmp_path / "own.md"  # a file's own repeat still runs: its context (the commands before it) may differ
    own.write_text("```bash\npython train.py\nhlat summary\npython train.py\n```\n")
    assert [p.action for _, p in Plan.of([own]).items] == ["tiny", "run", "tiny"]
    for c, p in plan.items:
        if p.why.startswith(RAN_BEFORE):
            earlier, ran = where[p.why.removeprefix(RAN_BEFORE)]
            assert earlier.text == c.text and earlier.file != c.file and ran.action != "skip", c.where


def test_every_exception_is_still_a_command_of_the_docs() -> None:
    texts = {c.text for c in all_commands()}
    stale = sorted(set(EXCEPTIONS) - texts)
    assert not stale, f"EXCEPTIONS lists commands that left README.md and docs/: {stale}"


def test_the_lane_runs_the_commands_of_every_doc() -> None:
    names = [str(p.relative_to(ROOT)) for p in sources()]
    assert names[0] == "README.md" and "ARCHITECTURE.md" in names
    assert {"docs/trn1.md", "docs/evaluation.md", "docs/fault-recovery.md"} <= set(names)
    files = {c.file for c, _ in Plan.of().items}
    assert {"README.md", "docs/evaluation.md", "docs/data.md", "docs/trn1.md", "docs/health.md"} <= files
    ids = [c.where for c, _ in Plan.of().items]
    assert len(ids) == len(set(ids)), "two commands share a test id"


def test_the_readme_starts_with_its_two_commands_then_activation() -> None:
    first = [c.text for c in commands()[:3]]
    assert first == ["make demo", "make test", ACTIVATE]


def test_commands_are_runnable_as_written() -> None:
    """No placeholders to fill in and no venv paths: after activation the README's commands are verbatim."""
    for c in all_commands():
        assert not re.search(r"<[a-z][a-z _-]*>", c.text), f"{c.where}: a placeholder in `{c.text}`"
        assert ".venv/bin/" not in c.text or c.text == ACTIVATE, f"{c.where}: `{c.text}` (activate instead)"


def test_parsing_joins_continuations_and_drops_comments(tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(
        "# T\n\n## Sec\n```bash\npython train.py a=1 \\\n    b=2   # two\n# only a comment\n"
        "echo '#kept' # gone\n```\n```python\nnot = 'a command'\n```\n"
    )
    assert commands(readme) == [Command("python train.py a=1 b=2", 5, "Sec"), Command("echo '#kept'", 8, "Sec")]
    doc = tmp_path / "topic.md"
    doc.write_text("# Topic\n\n```bash\nhlat plan\n```\n")
    assert [(c.where, c.section) for c in commands(doc)] == [("topic.md:4", "Topic")]


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


def test_every_training_command_of_the_docs_is_a_valid_config_and_layout() -> None:
    """Also the ones the lane cannot run (8 GPUs, trn1 clusters): composed and checked as the trainer would, up to
    the batch and rank layout, so a README command that a GPU box would refuse (a global batch not divisible by the
    micro-batch x 8 ranks) fails here."""
    from hlat.config import ConfigError, to_run_config
    from hlat.parallel import ParallelDims
    from tests.conftest import compose_cfg

    checked = 0
    for c in all_commands():
        found = _train_overrides(c.text)
        if found is None:
            continue
        overrides, world = found
        cfg = to_run_config(compose_cfg(*overrides))
        try:
            ParallelDims.build(cfg.parallelism, world or cfg.cluster.world_size, cfg.model, cfg.train)
        except ConfigError as e:
            raise AssertionError(f"{c.where}: `{c.text}`: {e}") from None
        checked += 1
    assert checked >= 20


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in path.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def test_every_doc_says_what_it_covers_first() -> None:
    for path in sources()[1:]:
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# ") and not lines[1] and lines[2] and not lines[2].startswith(("#", "|", "```")), (
            f"{path.relative_to(ROOT)}: start with a title, then a line that says what the file covers"
        )


def test_links_between_the_docs_lead_to_a_file_and_a_heading() -> None:
    """A moved section or a renamed heading breaks the links to it: each relative link names an existing file (and,
    with ``#anchor``, one of its headings)."""
    broken = []
    for path in sources():
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            name, _, anchor = target.partition("#")
            dest = (path.parent / name).resolve() if name else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_a_broken_anchor(tmp_path) -> None:
    doc = tmp_path / "a.md"
    doc.write_text("# A\n\n## The real NxD on this CPU: the NxD lane (`make test-neuron`)\n")
    assert "the-real-nxd-on-this-cpu-the-nxd-lane-make-test-neuron" in _anchors(doc)
    assert _slug("MLflow's UI") == "mlflows-ui" and _slug("Config groups (`conf/`)") == "config-groups-conf"
