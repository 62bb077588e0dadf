"""Using a trained model: lm-eval on checkpoints, greedy inference, and the Hugging Face format both ways.

May import: anything below the command line (config, core, data, backends, track, checkpoint); never
``hlat.train`` or ``hlat.cli``.
"""
