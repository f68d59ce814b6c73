"""raydl export: a trained checkpoint as a Hugging Face model directory, a torch.export program, ONNX, or a LoRA
run's peft adapter directory."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("export", help="Export a checkpoint: --format hf (save_pretrained, model.name=hf), pt2 "
                       "(torch.export, any model) or onnx (any model with example_inputs).", description=__doc__)
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="A run directory (its newest usable checkpoint) or "
                   "one checkpoint directory (runs/<run>/train/step_NNNNNNNN), saved at any layout.")
    p.add_argument("--format", dest="fmt", choices=("hf", "pt2", "onnx", "peft"),
                   help="hf: config.json + model.safetensors (+ the dataset's tokenizer.json), loadable with "
                   "transformers' from_pretrained (a LoRA run's adapters merged into its base weights); pt2: "
                   "model.pt2, loadable with torch.export.load; onnx: model.onnx (input 'inputs', output 'outputs'), "
                   "for onnxruntime or TensorRT (pip install \"raydl[onnx]\"); peft: a LoRA run's adapters alone, "
                   "a directory that peft.PeftModel.from_pretrained loads onto the run's base model.")
    p.add_argument("--out", help="New directory to write (must not exist, or be empty).")
    p.add_argument("--adapter", metavar="DIR", help="Same as --format peft --out DIR (train.lora runs).")
    p.add_argument("--config", help="The run's config.yaml, when the checkpoint is not inside its run directory "
                   "(checkpoint.storage_path).")
    p.set_defaults(func=run)


def run(args) -> int:
    from raydl.export import export

    from raydl.errors import ConfigError

    if args.adapter and (args.out or args.fmt not in (None, "peft")):
        raise ConfigError("--adapter", "is given with --out or another --format", "pass --adapter DIR alone "
                          "(it is --format peft --out DIR), or --format and --out")
    fmt, out = ("peft", args.adapter) if args.adapter else (args.fmt, args.out)
    if not fmt or not out:
        raise ConfigError("--format" if not fmt else "--out", "is missing", "pass --format FORMAT --out DIR, or "
                          "--adapter DIR for a LoRA run's adapters")
    out = export(args.source, fmt=fmt, out=out, config=args.config)
    log.info(f"exported {args.source} as {fmt} to {out}")
    return 0
