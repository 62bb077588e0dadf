"""The multirun (``python train.py -m``): resumable sweeps whose every job reports back.

Owns ``job`` (one job: skip it if it already finished, continue it from its checkpoints, or train it), ``callback``
(Hydra's callback: the sweep's MLflow parent run, the comparison at the end, a failed sweep named and exited 1) and
``launcher`` (hlat's subclasses of the submitit launchers, which collect every job's result even when one is killed;
``src/hydra_plugins/`` registers them). What a sweep records about its jobs (hashes, tags, the job files) is
``hlat.track.sweep``'s, and its parent run's view in the MLflow UI ``hlat.track.sweep_views``'s.

Sits beside ``hlat.train``: ``hlat.train.entry`` hands a multirun's job to ``job.run_job``, which calls back the
training it is given. May import: everything below the commands (``hlat.train`` included). Never ``hlat.eval``,
``hlat.cli`` or ``hlat.deploy`` (tests/unit/test_import_boundaries.py draws the graph).
"""
