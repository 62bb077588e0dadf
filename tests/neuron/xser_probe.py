"""Run in one process (``cluster=xla_cpu``): load neuron checkpoints saved in other layouts into hlat's model and
optimizer through the real NxD, the way a resume does (``hlat.checkpoint.xser_write.resharded_copy``), and save each
again with NxD's ``save_checkpoint``, so that a test can compare what NxD restored with what was saved.

Usage: ``xser_probe.py OUT SOURCE... -- OVERRIDES...``: each ``SOURCE`` step directory is saved as ``OUT/<i>``.
Prints ``{"saved": [dirs], "reads": [...]}``: per source, the tensor bytes the resharded copy read (``read``), the
tensor bytes it holds (``held``), the saved files whose tensor header it had to read (``headers``: their info file
did not say) or that it read whole (``whole``), and the kernel's count of every byte the copy read (``rchar``:
pickles, zip headers and the manifest included).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import ClassVar

import torch

from hlat.backends.neuron import NeuronBackend
from hlat.checkpoint import xser_write
from hlat.checkpoint.xser_reshard import RangedPieces
from hlat.checkpoint.xser_write import resharded_copy
from hlat.config.compose import compose_run_config
from hlat.optim import param_groups


class Counted(RangedPieces):
    """The ranged reader ``resharded_copy`` uses, kept for its counts."""

    made: ClassVar[list[RangedPieces]] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        Counted.made.append(self)


def rchar() -> int:
    """Bytes this process has read so far, as the kernel counts them."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar"))[7:])


def main(out: Path, sources: list[Path], overrides: list[str]) -> None:
    cfg = compose_run_config(overrides)
    backend = NeuronBackend(cfg)
    backend.setup()
    model = backend.build_model(backend.dims)
    optimizer = backend.build_optimizer(model, param_groups(model, cfg.optimizer))
    saved, reads = [], []
    xser_write.RangedPieces = Counted
    for i, source in enumerate(sources):
        start = rchar()
        copy = resharded_copy(source, cfg, backend.dims, 0)
        everything = rchar() - start
        assert copy is not None, f"{source} is already in this layout: nothing would be resharded"
        held = sum(torch.load(f, weights_only=True).nbytes for f in copy.rglob("tensor_*.pt"))
        pieces = Counted.made[-1]
        counts = {"read": pieces.bytes_read, "held": held, "headers": pieces.headers, "whole": pieces.whole}
        reads.append({**counts, "rchar": everything})
        extra = backend.load(copy, model, optimizer)
        shutil.rmtree(copy)
        (out / str(i)).mkdir(parents=True)
        backend.save(out / str(i), model, optimizer, extra, async_save=False)
        saved.append(str(out / str(i)))
    print(json.dumps({"saved": saved, "reads": reads}), flush=True)


if __name__ == "__main__":
    split = sys.argv.index("--")
    main(Path(sys.argv[1]), [Path(p) for p in sys.argv[2:split]], sys.argv[split + 1 :])
