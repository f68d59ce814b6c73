"""raydl export: a trained checkpoint as a Hugging Face model directory, a torch.export program or ONNX."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("export", help="Export a checkpoint: --format hf (save_pretrained, model.name=hf), pt2 "
                       "(torch.export, any model) or onnx (any model with example_inputs).", description=__doc__)
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="A run directory (its newest usable checkpoint) or "
                   "one checkpoint directory (runs/<run>/train/step_NNNNNNNN), saved at any layout.")
    p.add_argument("--format", dest="fmt", required=True, choices=("hf", "pt2", "onnx"),
                   help="hf: config.json + model.safetensors (+ the dataset's tokenizer.json), loadable with "
                   "transformers' from_pretrained; pt2: model.pt2, loadable with torch.export.load; onnx: model.onnx "
                   "(input 'inputs', output 'outputs'), for onnxruntime or TensorRT (pip install \"raydl[onnx]\").")
    p.add_argument("--out", required=True, help="New directory to write (must not exist, or be empty).")
    p.add_argument("--config", help="The run's config.yaml, when the checkpoint is not inside its run directory "
                   "(checkpoint.storage_path).")
    p.set_defaults(func=run)


def run(args) -> int:
    from raydl.export import export

    out = export(args.source, fmt=args.fmt, out=args.out, config=args.config)
    log.info(f"exported {args.source} as {args.fmt} to {out}")
    return 0
