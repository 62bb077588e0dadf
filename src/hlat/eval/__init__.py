"""Using a trained model: lm-eval on checkpoints, greedy inference, and the Hugging Face format both ways.

Owns ``harness`` (``HlatLM``, hlat as an lm-eval model, and ``python -m hlat.eval.harness``), ``run``
(``hlat eval``: checkpoints -> scores -> MLflow), ``inference`` (load a checkpoint for inference, greedy decoding),
``kv_cache`` (incremental decoding with a KV cache, outside the model), ``hf`` (``hlat export`` / ``hlat import``),
``hf_tokenizer`` (a sentencepiece model as ``tokenizer.json``) and ``tasks`` (the builtin lm-eval task files, and
``python -m hlat.eval.tasks``: whether lm-eval knows a task).

May import: anything below the command line (``hlat.config``, core, ``hlat.data``, ``hlat.backends``,
``hlat.track``, ``hlat.checkpoint``: checkpoints and their weights). Never ``hlat.train`` or ``hlat.cli``.
"""
