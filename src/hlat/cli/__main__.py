"""``python -m hlat.cli ...``: the ``hlat`` command without its entry point (evaluations along training use it)."""

from hlat.cli import main

main()
