"""Small lm-evaluation-harness tasks written for hlat: offline, no downloads, seconds to run.

``hlat_local`` groups ``hlat_local_mc`` (multiple choice), ``hlat_local_ppl`` (perplexity) and ``hlat_local_gen``
(greedy generation), each a YAML beside its JSONL. ``check_tasks`` (``python -m hlat.eval.tasks NAME...``, run by
training before it builds anything) makes an unknown task fail at the start, not hours into a run.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hlat.config import ConfigError

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from datasets import DatasetDict
    from lm_eval.tasks import TaskManager

TASKS_DIR = Path(__file__).resolve().parent
"""The directory holding the task YAMLs and their data (an lm-eval ``--include_path``)."""
TASKS = ("hlat_local_mc", "hlat_local_ppl", "hlat_local_gen")
"""The local tasks; ``hlat_local`` groups them."""


def load_jsonl(data_file: str, **_: Any) -> DatasetDict:
    """A task's documents as a one-split (``test``) dataset, read from ``data_file`` in this directory."""
    from datasets import Dataset, DatasetDict

    with open(TASKS_DIR / data_file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return DatasetDict({"test": Dataset.from_list(rows)})


class _QuietCustomDataset(logging.Filter):
    """Drops lm-eval's per-task hint on passing kwargs to a ``custom_dataset``: ours takes none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def task_manager(include_defaults: bool = False, extra_paths: list[str | Path] | None = None) -> TaskManager:
    """An lm-eval ``TaskManager`` that knows the local tasks (and the built-in ones, ~10 s, if ``include_defaults``)."""
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval.api.task").addFilter(_QUIET)
    return TaskManager(include_path=[str(TASKS_DIR), *map(str, extra_paths or [])], include_defaults=include_defaults)


_QUIET = _QuietCustomDataset()


INSTALL = 'pip install -c constraints.txt -e ".[eval]" (in a checkout: make install-eval)'
"""How to get lm-evaluation-harness: the ``eval`` extra, which ``make demo`` does not install."""


def check_tasks(names: Sequence[str], preset: str, cache_dir: str | Path | None = None) -> None:
    """Refuse, before anything is loaded, what lm-eval could not evaluate: no lm-eval, or a name it does not know.

    lm-eval's built-in names are indexed (and cached in ``cache_dir``) only for a name that is not hlat's.

    Raises:
        ConfigError: lm-eval cannot be imported (names the extra to install), or a name is unknown (names the closest).
    """
    try:
        known = set(task_manager().all_tasks)
    except ImportError as e:
        raise ConfigError(
            f"eval={preset} needs lm-evaluation-harness (the eval extra), which this Python cannot import ({e}): "
            f"{INSTALL}"
        ) from None
    if any(n not in known for n in names):
        known |= builtin_tasks(cache_dir)
    unknown = [n for n in names if n not in known]
    if not unknown:
        return
    near = [m for n in unknown for m in difflib.get_close_matches(n, sorted(known), n=3, cutoff=0.75)]
    hint = f" (did you mean {', '.join(dict.fromkeys(near))}?)" if near else ""
    raise ConfigError(
        f"eval.tasks: lm-eval knows no task, group or tag named {', '.join(map(repr, unknown))}{hint} "
        f"in eval={preset}; fix eval.tasks (`python -m hlat.eval.harness ls tasks` lists every name)"
    )


def builtin_tasks(cache_dir: str | Path | None = None) -> set[str]:
    """The names of lm-eval's built-in tasks, groups and tags (~10 s to index), cached in ``cache_dir``.

    The cache is keyed by the path, size and time of each task YAML (~0.2 s), so an upgrade or edit is never missed.
    """
    import lm_eval
    from lm_eval.tasks import TaskManager

    root = Path(lm_eval.__file__).resolve().parent / "tasks"
    path = Path(cache_dir).expanduser() / "lm_eval_tasks.json" if cache_dir is not None else None
    fingerprint = _fingerprint(root)
    try:
        cached = json.loads(path.read_text()) if path is not None else {}
        if cached.get("fingerprint") == fingerprint:
            return set(cached["names"])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass  # no cache, or not ours: index again
    names = TaskManager(include_defaults=True).all_tasks
    if path is not None:
        try:  # atomically: the ranks of a job may check at once
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"fingerprint": fingerprint, "names": sorted(names)}))
            os.replace(tmp, path)
        except OSError as e:
            log.debug("cannot cache lm-eval's task names in %s: %s", path, e)
    return set(names)


def _fingerprint(root: Path) -> str:
    """A hash of every YAML under ``root``: its path, size and modification time."""
    h = hashlib.sha256(str(root).encode())
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith((".yaml", ".yml"))):
            st = os.stat(os.path.join(d, name))
            h.update(f"{os.path.relpath(os.path.join(d, name), root)} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hlat.eval.tasks [--preset P] [--cache-dir D] NAME...``: exit 0, or 2 with one ``hlat:`` line."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(
        prog="python -m hlat.eval.tasks", description="Check that lm-eval can be imported and knows every task NAME."
    )
    parser.add_argument("names", nargs="+", metavar="NAME")
    parser.add_argument("--preset", default="local", help="the eval preset, for the message")
    parser.add_argument("--cache-dir", default=None, help="cache of lm-eval's built-in task names (data.cache_dir)")
    args = parser.parse_args(argv)
    try:
        check_tasks(args.names, args.preset, args.cache_dir)
    except ConfigError as e:
        print(f"hlat: configuration error: {e}", file=sys.stderr)
        return 2
    return 0
