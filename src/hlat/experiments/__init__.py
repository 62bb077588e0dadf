"""Experiments that change how the model computes, kept out of the core model: each brings its own module.

- ``information_leak``: attention that sees future tokens (``model.mask_leak``), the HLAT slides' bug (p.28).
"""
