"""A Hugging Face Llama directory with random weights, written shard by shard (never a whole model in memory),
and a token dataset of its vocabulary: what `model.options.weights` and `data.path` read, with nothing downloaded.

    python examples/random_llama.py --out llama_tiny --data data_tiny                     # a tiny one, seconds
    python examples/random_llama.py --out llama_1b --data data_1b --size llama-3.2-1b      # 1.24B, ~5 GB fp32

The directory is what save_pretrained writes for a sharded model (config.json, model-0000K-of-0000N.safetensors,
model.safetensors.index.json); tied embeddings (as Llama 3.2 1B) write no lm_head.weight. The dataset is random
token rows ("raydl data prepare --from parquet").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    # Llama 3.2 1B's shape at a size CI trains in minutes: the same code paths (GQA, tied embeddings, several shards)
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=8192),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256),
}


def config(size: str, seq_len: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **SIZES[size], "rope_theta": 500000.0,
            "max_position_embeddings": max(seq_len, 2048), "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
            "hidden_act": "silu", "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 1}


def _layer(cfg: dict, i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    d, ff, heads, kv = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads"))
    kv_width = d // heads * kv
    shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv_width, d), "self_attn.v_proj": (kv_width, d),
              "self_attn.o_proj": (d, d), "mlp.gate_proj": (ff, d), "mlp.up_proj": (ff, d), "mlp.down_proj": (d, ff)}
    tensors = {f"model.layers.{i}.{name}.weight": _normal(shape, gen) for name, shape in shapes.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(d)
    return tensors


def _normal(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape).normal_(0.0, 0.02, generator=gen)


def write_weights(out: Path, size: str = "tiny", *, seq_len: int = 16, seed: int = 0) -> None:
    """config.json and one safetensors file per piece: the embeddings, each decoder layer, the final norm."""
    cfg = config(size, seq_len)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    gen = torch.Generator().manual_seed(seed)
    pieces = [lambda: {"model.embed_tokens.weight": _normal((cfg["vocab_size"], cfg["hidden_size"]), gen)}]
    pieces += [lambda i=i: _layer(cfg, i, gen) for i in range(cfg["num_hidden_layers"])]
    pieces += [lambda: {"model.norm.weight": torch.ones(cfg["hidden_size"])}]
    weight_map, total = {}, 0
    for k, piece in enumerate(pieces):
        name = f"model-{k + 1:05d}-of-{len(pieces):05d}.safetensors"
        tensors = piece()   # one piece in memory at a time
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def write_tokens(out: Path, vocab_size: int, *, seq_len: int = 16, rows: int = 256, seed: int = 0) -> Path:
    """A parquet table of random token rows whose largest id is vocab_size - 1 (the dataset's vocabulary)."""
    ids = np.random.default_rng(seed).integers(0, vocab_size, (rows, seq_len + 1))
    ids[0, 0] = vocab_size - 1
    row = pa.list_(pa.int64(), seq_len)
    table = pa.table({"id": pa.array(np.arange(rows)),
                      "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(ids[:, :-1].ravel()), type=row),
                      "labels": pa.FixedSizeListArray.from_arrays(pa.array(ids[:, 1:].ravel()), type=row)})
    out.mkdir(parents=True)
    pq.write_table(table, out / "tokens.parquet")
    return out / "tokens.parquet"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="new directory for config.json and the safetensors shards")
    parser.add_argument("--data", required=True, help="new directory for the token dataset (raydl data prepare)")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--seq-len", type=int, default=16)
    args = parser.parse_args()
    write_weights(Path(args.out), args.size, seq_len=args.seq_len)
    source = write_tokens(Path(args.data + ".parquet-source"), SIZES[args.size]["vocab_size"], seq_len=args.seq_len)
    from raydl.cli import main as raydl

    raise SystemExit(raydl(["data", "prepare", str(source), "--from", "parquet", "--out", args.data, "--quiet"]))


if __name__ == "__main__":
    main()
