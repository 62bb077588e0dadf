"""``python -m hlat.eval.tasks NAME...``: whether lm-eval can evaluate these tasks (:func:`check_tasks`)."""

from hlat.eval.tasks import main

raise SystemExit(main())
