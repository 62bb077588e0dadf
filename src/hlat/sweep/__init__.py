"""The multirun (``python train.py -m``): resumable sweeps whose every job reports back.

``job`` (skip, continue or train), ``callback`` (the parent run, the comparison, a failed sweep exits 1) and
``launcher`` (submitit launchers that collect every job). Beside ``hlat.train``; may import everything below the
commands.
"""
