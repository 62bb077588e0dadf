"""Planning without a device: will a layout fit, how fast will a step be, and what would the paper's runs cost.

Owns ``memory`` (per-device memory estimate, the pre-flight fit check and the fixes it suggests), ``step_model``
(the roofline step-time / MFU / cost model), ``peak`` (this host's measured matmul peak, the MFU denominator),
``bf16_policy`` (whether bf16 matmuls run natively or emulated on this host), ``report`` (the plan of a config and
its text) and ``paper`` (calibration and validation against the paper's figures); ``command`` is the ``hlat plan``
command line, in the top layer with the other commands.

May import: ``hlat.config`` and the core modules (``sizing``, ``parallel``, ``layouts``, ``host``). Never the
trainer, tracking, evaluation or the command line: the planner must run anywhere, in a second, without torch where
it can (``hlat plan`` / ``hlat summary``).
"""
