"""Planning without a device: will a layout fit, how fast will a step be, and what would the paper's runs cost.

``command`` (``hlat plan``) and ``graphs_command`` (``hlat graphs``) sit in the top layer with the other commands.
May import: ``hlat.config`` and the core modules only, so that the planner runs anywhere in a second, without torch
where it can.
"""
