"""Run in one process (``cluster=xla_cpu``): load neuron checkpoints saved in other layouts into hlat's model and
optimizer through the real NxD, the way a resume does (``hlat.checkpoint.xser_write.resharded_copy``), and save each
again with NxD's ``save_checkpoint``, so that a test can compare what NxD restored with what was saved.

Usage: ``xser_probe.py OUT SOURCE... -- OVERRIDES...``: each ``SOURCE`` step directory is saved as ``OUT/<i>``.
Prints ``{"saved": [dirs]}``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from hlat.backends.neuron import NeuronBackend
from hlat.checkpoint.xser_write import resharded_copy
from hlat.config.compose import compose_run_config
from hlat.optim import param_groups


def main(out: Path, sources: list[Path], overrides: list[str]) -> None:
    cfg = compose_run_config(overrides)
    backend = NeuronBackend(cfg)
    backend.setup()
    model = backend.build_model(backend.dims)
    optimizer = backend.build_optimizer(model, param_groups(model, cfg.optimizer))
    saved = []
    for i, source in enumerate(sources):
        copy = resharded_copy(source, cfg, backend.dims, 0)
        assert copy is not None, f"{source} is already in this layout: nothing would be resharded"
        extra = backend.load(copy, model, optimizer)
        shutil.rmtree(copy)
        (out / str(i)).mkdir(parents=True)
        backend.save(out / str(i), model, optimizer, extra, async_save=False)
        saved.append(str(out / str(i)))
    print(json.dumps({"saved": saved}), flush=True)


if __name__ == "__main__":
    split = sys.argv.index("--")
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:split]], sys.argv[split + 1 :])
