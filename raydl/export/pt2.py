"""--format pt2: a checkpoint of any raydl model as a `torch.export` program.

    program = torch.export.load("DIR/model.pt2").module()
    outputs = program(inputs)    # inputs as ModelSpec.inputs_targets gives them (gpt: int64 token ids)

The batch size is free; for token models so is the sequence length, up to the dataset's. Before
DIR appears, the saved program is loaded back and its outputs compared with raydl's on a batch.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.export import Dim

from raydl.errors import ConfigError
from raydl.export import require_close
from raydl.export.trained import Trained

FILE = "model.pt2"


class Pt2Export:
    def __init__(self, trained: Trained):
        self.model = trained.load_into(trained.build())
        self.example = trained.choice.spec.example_inputs(trained.meta, 2)
        free = {0: Dim("batch")}
        if trained.choice.spec.task == "tokens":
            free[1] = Dim("seq", max=trained.meta["seq_len"])
        try:
            self.program = torch.export.export(self.model, (self.example,), dynamic_shapes=(free,))
        except Exception as e:   # torch.export refuses data-dependent Python control flow, among others
            raise ConfigError("--format", f"is pt2, but torch.export cannot trace model "
                              f"'{trained.choice.spec.name}' ({type(e).__name__}: {str(e).splitlines()[0][:300]})",
                              "make its forward traceable (see the torch.export docs), or use --format hf for a "
                              "model.name=hf model") from None

    def write(self, out: Path) -> None:
        torch.export.save(self.program, out / FILE)
        self._check(out)

    @torch.no_grad()
    def _check(self, out: Path) -> None:
        loaded = torch.export.load(out / FILE).module()
        require_close(loaded(self.example), self.model(self.example), "program")
