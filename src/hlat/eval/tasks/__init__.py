"""Small lm-evaluation-harness tasks written for hlat: offline, no downloads, seconds to run.

- ``hlat_local_mc``: 30 multiple-choice completions, mostly of Python-docstring phrases (acc, acc_norm);
- ``hlat_local_ppl``: rolling log-likelihood of 20 short passages (word/byte perplexity, bits per byte);
- ``hlat_local_gen``: 12 greedy generations continuing a repeated list (exact match);
- ``hlat_local``: the group of all three.

Each task is a YAML next to its JSONL; ``load_jsonl`` (the tasks' ``custom_dataset``) reads the JSONL from this
directory wherever the package is installed, so no path depends on the working directory. ``task_manager`` indexes
only this directory unless the built-in tasks are asked for (indexing those ~15k YAMLs takes ~10 s).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import DatasetDict
    from lm_eval.tasks import TaskManager

TASKS_DIR = Path(__file__).resolve().parent
"""The directory holding the task YAMLs and their data (an lm-eval ``--include_path``)."""
TASKS = ("hlat_local_mc", "hlat_local_ppl", "hlat_local_gen")
"""The local tasks; ``hlat_local`` groups them."""


def load_jsonl(data_file: str, **_: Any) -> DatasetDict:
    """A task's documents as a one-split (``test``) dataset, read from ``data_file`` in this directory.

    Args:
        data_file: The JSONL file name (the YAML's ``dataset_kwargs.data_file``).
        **_: The task metadata lm-eval passes to every ``custom_dataset`` (unused).
    """
    from datasets import Dataset, DatasetDict

    with open(TASKS_DIR / data_file, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return DatasetDict({"test": Dataset.from_list(rows)})


class _QuietCustomDataset(logging.Filter):
    """Drops lm-eval's per-task hint on passing kwargs to a ``custom_dataset``: ours takes none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def task_manager(include_defaults: bool = False, extra_paths: list[str | Path] | None = None) -> TaskManager:
    """An lm-eval ``TaskManager`` that knows the local tasks (and the built-in ones if ``include_defaults``).

    Args:
        include_defaults: Also index lm-eval's built-in tasks (MMLU, HellaSwag, ...; ~10 s, and their datasets are
            downloaded from the Hugging Face Hub when a task runs).
        extra_paths: More directories of task YAMLs to index.
    """
    from lm_eval.tasks import TaskManager

    logging.getLogger("lm_eval.api.task").addFilter(_QUIET)
    return TaskManager(include_path=[str(TASKS_DIR), *map(str, extra_paths or [])], include_defaults=include_defaults)


_QUIET = _QuietCustomDataset()
