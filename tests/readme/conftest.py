"""The README lane (``make test-readme``): collected only with ``HLAT_README_LANE=1``, since it runs every command
of the README in order (many of them train), which takes minutes."""

from __future__ import annotations

import os

if os.environ.get("HLAT_README_LANE") != "1":
    collect_ignore_glob = ["test_*.py"]
