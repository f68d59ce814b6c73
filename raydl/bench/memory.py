"""raydl bench memory: peak memory per worker and time to first step, whole vs meta build, beside the prediction.

    raydl bench memory --repeats 3                                  # every model x layout (hours on 2 cores)
    raydl bench memory --repeats 1 --models gpt-302m --layouts dp2-fsdp

Each run is a real `raydl train` (a subprocess, 2 steps, SGD without momentum, micro-batch 1) whose workers write
their peaks with debug.memory_dir (raydl.telemetry.memory_marks: RSS high-water marks on CPU). Sides, alternated:
`before` builds the whole model on every worker (debug.whole_model_build, the path raydl took before building on
meta), `after` builds on meta and materializes what the rank owns. A tiny model's run of every layout is the
baseline of the whole-run peak. The prediction (raydl.parallel.memory) is computed here, before the run, from the
same config. A run whose predicted total exceeds 4 GiB takes /tmp/raydl-bigmem.lock (`flock`) so that two memory-
heavy jobs on this shared machine never overlap. The issue's targets are checked and printed:
    build        during build and load, no worker above its own share (+ the largest tensor) by more than 25%:
                 its peak after the layout, materialization and load above its memory once built on meta (the
                 model library's code imported, no storage); `build_from_start` also counts that import
                 (transformers' modeling code: ~70 MiB, the same for any model size)
    fsdp         at dp=2 FSDP, the whole-run peak above the tiny model's <= 0.75 x the full fp32 model
    first step   at dp=2 FSDP, the 1B model's time from command to first step <= 0.6 x before
    prediction   predicted peak within 15% of the measured one (above the tiny model's of the same library)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from raydl.bench import harness
from raydl.bench.startup import private_env

BIN = Path(sys.executable).parent
LOCK = "/tmp/raydl-bigmem.lock"
BIG_BYTES = 4 * 2**30
TARGETS = {"build_over_share": 1.25, "build_from_start_over_share": 1.25, "fsdp_run_over_model": 0.75,
           "first_step_after_over_before": 0.6, "prediction_error": 0.15}
COMMON = ["train.optimizer=sgd", "train.momentum=0", "train.micro_batch_size=1", "train.global_batch_size=2",
          "train.max_steps=2", "train.eval_batches=1", "data.builtin_samples=4096", "telemetry.progress=false",
          "checkpoint.every_steps=1000", "train.warmup_steps=1"]
MODELS = {
    "gpt-tiny": ["model.options.layers=2", "model.options.width=64", "model.options.heads=4"],
    "gpt-100m": ["model.options.layers=12", "model.options.width=768", "model.options.heads=12"],
    "gpt-302m": ["model.options.layers=24", "model.options.width=1024", "model.options.heads=16"],
    "gpt-1b": ["model.options.layers=24", "model.options.width=1856", "model.options.heads=16"],
    "llama-tiny": ["model.name=hf", "model.options.weights={weights[llama-tiny]}"],
    "llama-135m": ["model.name=hf", "model.options.weights={weights[llama-135m]}"],
}
# The baseline of a model's whole-run peak: the tiny model of its own library, so that the library's code (~70 MiB
# of transformers' modules per worker) is in both runs and the difference is the model's memory alone.
TINY = {"gpt": "gpt-tiny", "llama": "llama-tiny"}
LLAMAS = {"llama-135m": {"hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16,
                         "num_key_value_heads": 4, "intermediate_size": 2816},
          "llama-tiny": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "num_key_value_heads": 2, "intermediate_size": 128}}
LAYOUTS = {
    "dp2-fsdp": ["scaling.min_workers=2", "scaling.max_workers=2", "parallel.dp_wrapper=fsdp"],
    "pp2": ["scaling.min_workers=2", "scaling.max_workers=2", "parallel.pp_degree=2", "parallel.num_microbatches=2"],
    "dp1": ["scaling.min_workers=1", "scaling.max_workers=1"],
}
SIDES = {"before": ["debug.whole_model_build=true"], "after": []}


def dataset_meta(data_cache: Path) -> dict[str, Any]:
    """The built-in token dataset's vocabulary and length (generated into `data_cache` on first use)."""
    from raydl.models.choice import choose_model
    from raydl.overrides import load_config

    cfg = load_config(None, [*COMMON, f"data.cache_dir={data_cache}"])
    return choose_model(cfg.model, None).open_dataset(cfg).meta


def write_llama(directory: Path, meta: dict[str, Any], dims: dict[str, int]) -> Path:
    """A Llama with random weights as save_pretrained writes it (config.json + safetensors): nothing downloaded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=meta["vocab_size"], max_position_embeddings=meta["seq_len"],
                         tie_word_embeddings=False, **dims)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def predicted(overrides: list[str], data_cache: Path, device_type: str = "cpu") -> dict[str, Any]:
    """The prediction for this config, per pipeline rank (MiB), what building holds, and the model's fp32 size."""
    import torch

    from raydl.driver.lora_base import adapted
    from raydl.models.build import SkipWeightInit
    from raydl.models.choice import choose_model
    from raydl.overrides import load_config
    from raydl.parallel.memory import Setting, build_bytes
    from raydl.parallel.memory_probe import model_memory
    from raydl.parallel.memory_fit import predict_memory
    from raydl.parallel.mesh import layout_for

    cfg = load_config(None, [*overrides, f"data.cache_dir={data_cache}"])
    chosen = choose_model(cfg.model, None)
    info = chosen.open_dataset(cfg)
    with torch.device("meta"), SkipWeightInit():
        model = chosen.build(info.meta, pp_degree=cfg.parallel.pp_degree)
    mm = model_memory(adapted(chosen, info.meta, cfg, model), chosen.spec, info.meta)   # train.lora's adapters
    layout = layout_for(cfg, cfg.scaling.max_workers, num_blocks=len(mm.blocks), model_memory=mm)
    p = predict_memory(layout, mm, Setting.from_config(cfg, device_type))
    share = build_bytes(mm, dp=layout.dp, pp=layout.pp, schedule=layout.schedule, stage_cuts=layout.stage_cuts,
                        wrapper=layout.dp_wrapper)
    return {"peak_mib_by_pp_rank": [b / 2**20 for b in p.rank_peak_bytes], "breakdown": p.breakdown(),
            "share_mib": share / 2**20, "model_mib": mm.param_bytes / 2**20, "workers": layout.world_size,
            "total_bytes": sum(p.rank_peak_bytes) * layout.dp}


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_for_memory(need: int, timeout_s: float = 600) -> None:
    """Start a run only when the machine has room for it (at most 90% of it): other work here comes and goes."""
    need = min(need, int(0.9 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")))
    deadline = time.monotonic() + timeout_s
    while available_bytes() < need and time.monotonic() < deadline:
        time.sleep(5)


def train_once(work: Path, overrides: list[str], need: int, attempts: int = 2) -> dict[str, Any]:
    """One `raydl train`: each rank's peaks (MiB) and the command -> first step time. A run killed by other work's
    memory on this shared machine is retried once."""
    run_dir, mem_dir = work / f"run-{time.time_ns()}", work / f"mem-{time.time_ns()}"
    sets = [*overrides, f"run.dir={run_dir}", f"debug.memory_dir={mem_dir}"]
    command = [str(BIN / "raydl"), "train", *(a for s in sets for a in ("--set", s))]
    if need > BIG_BYTES:
        command = ["flock", LOCK, *command]
    wait_for_memory(need)
    # Ray's memory monitor kills workers when the node is nearly full, whoever filled it: off for the measurement.
    env = private_env(work / "ray", RAY_memory_monitor_refresh_ms="0")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode and attempts > 1:
        shutil.rmtree(run_dir, ignore_errors=True)
        return train_once(work, overrides, need, attempts - 1)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    ranks = sorted((json.loads(p.read_text()) for p in mem_dir.glob("memory-rank*.json")), key=lambda r: r["rank"])
    startup = json.loads((run_dir / "summary.json").read_text())["startup"]
    shutil.rmtree(run_dir, ignore_errors=True)   # its final checkpoint is the model's size
    shutil.rmtree(mem_dir, ignore_errors=True)
    out: dict[str, Any] = {"to_first_step_s": startup["to_first_step_s"],
                           **{f"phase:{name}": seconds for name, seconds in startup["phase_s"].items()}}
    for r in ranks:
        out[f"rank{r['rank']}:start_mib"] = r["start_peak_mib"]
        out[f"rank{r['rank']}:meta_now_mib"] = r["meta_now_mib"]
        out[f"rank{r['rank']}:built_mib"] = r["built_peak_mib"]
        out[f"rank{r['rank']}:end_mib"] = r["end_peak_mib"]
        out[f"rank{r['rank']}:pp_rank"] = r["coords"][1]
    return out


def analyse(name: str, layout: str, stats: dict[str, dict], tiny: dict[str, dict], prediction: dict) -> dict:
    """Per rank and side: what build/load added, the whole-run peak above the tiny model's, against the targets."""
    rows: dict[str, Any] = {}
    for side, s in stats.items():
        ranks = sorted({k.split(":")[0] for k in s if k.startswith("rank")})
        per_rank = []
        for r in ranks:
            pp_rank = int(s[f"{r}:pp_rank"]["median"])
            build = s[f"{r}:built_mib"]["median"] - s[f"{r}:start_mib"]["median"]
            run = s[f"{r}:end_mib"]["median"] - tiny[f"{r}:end_mib"]["median"]
            want = prediction["peak_mib_by_pp_rank"][pp_rank]
            per_rank.append({"rank": r, "build_mib": round(build), "run_above_tiny_mib": round(run),
                             "predicted_mib": round(want), "prediction_error": round(run / want - 1, 3),
                             "build_over_share": round(build / prediction["share_mib"], 3),
                             "run_over_model": round(run / prediction["model_mib"], 3)})
            if side == "after":   # before, the whole model is built by the meta mark already
                load = s[f"{r}:built_mib"]["median"] - s[f"{r}:meta_now_mib"]["median"]
                per_rank[-1].update(load_mib=round(load), load_over_share=round(load / prediction["share_mib"], 3))
        phases = {k.split(":", 1)[1]: s[k]["median"] for k in s if k.startswith("phase:")}
        rows[side] = {"ranks": per_rank, "to_first_step_s": s["to_first_step_s"], "phase_s": phases}
    if "before" in rows:
        before, after = rows["before"]["to_first_step_s"]["median"], rows["after"]["to_first_step_s"]["median"]
        rows["first_step_after_over_before"] = round(after / before, 3)
    return {"model": name, "layout": layout, "prediction": prediction, **rows}


def report(row: dict) -> str:
    lines = [f"{row['model']} {row['layout']}: model {row['prediction']['model_mib']:,.0f} MiB fp32, own share "
             f"{row['prediction']['share_mib']:,.0f} MiB; predicted {row['prediction']['breakdown']}"]
    for side in (side for side in SIDES if side in row):
        t = row[side]["to_first_step_s"]
        for r in row[side]["ranks"]:
            load = (f" (of which after the meta build +{r['load_mib']:,} MiB, {r['load_over_share']:.2f} x share)"
                    if "load_mib" in r else "")
            lines.append(f"  {side:6s} {r['rank']}: build+load +{r['build_mib']:,} MiB ({r['build_over_share']:.2f} x "
                         f"share){load}, run {r['run_above_tiny_mib']:,} MiB above tiny ({r['run_over_model']:.2f} x model) "
                         f"vs predicted {r['predicted_mib']:,} ({100 * r['prediction_error']:+.0f}%)")
        lines.append(f"  {side:6s} {harness.describe('command -> first step', t, ' s')}")
        lines.append(f"  {side:6s} phases (s, medians; each ends at its mark): "
                     + ", ".join(f"{name} {seconds:.1f}" for name, seconds in row[side]["phase_s"].items()))
    if "first_step_after_over_before" in row:
        lines.append(f"  first step after/before: {row['first_step_after_over_before']:.2f}")
    return "\n".join(lines)


def targets(rows: list[dict]) -> dict[str, Any]:
    """The issue's four targets over the 'after' runs: the worst value of each and whether it is met."""
    after = [(row, r) for row in rows for r in row["after"]["ranks"]]
    fsdp = [r["run_over_model"] for row, r in after if row["layout"] == "dp2-fsdp"]
    first = [row["first_step_after_over_before"] for row in rows if row["layout"] == "dp2-fsdp"
             and row["model"] == "gpt-1b" and "first_step_after_over_before" in row]
    worst = {"build_over_share": max(r["load_over_share"] for _, r in after),
             "build_from_start_over_share": max(r["build_over_share"] for _, r in after),
             "fsdp_run_over_model": max(fsdp) if fsdp else None,
             "first_step_after_over_before": first[0] if first else None,
             "prediction_error": max(abs(r["prediction_error"]) for _, r in after)}
    return {name: {"worst": value, "target": TARGETS[name],
                   "met": None if value is None else value <= TARGETS[name]} for name, value in worst.items()}


def family(model: str) -> str:
    return model.split("-")[0]


def model_sets(model: str, weights: dict[str, str]) -> list[str]:
    return [o.format(weights=weights) for o in MODELS[model]]


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("memory", __doc__)
    p.set_defaults(repeats=3)
    p.add_argument("--models", nargs="+", default=[m for m in MODELS if m not in TINY.values()],
                   choices=[m for m in MODELS if m not in TINY.values()])
    p.add_argument("--after-only", action="store_true",
                   help="Skip the before side (the whole build on every worker): peaks and prediction only.")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--tiny-repeats", type=int, default=0, help="Runs of the tiny baseline per layout (0 = --repeats).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="More overrides for every run and its prediction (e.g. train.optimizer_in_backward=true).")
    args = harness.parse_args(p, argv)
    session = harness.Session("memory", args)
    work = Path(tempfile.mkdtemp(prefix="raydl-bench-mem-", dir="/tmp"))
    data = work / "data"
    families = sorted({family(name) for name in args.models})
    runs_of = {*args.models, *(TINY[f] for f in families)}
    weights = {name: str(write_llama(work / name, dataset_meta(data), dims))
               for name, dims in LLAMAS.items() if name in runs_of}
    rows = []
    try:
        for layout in args.layouts:
            base = [*COMMON, f"data.cache_dir={data}", *LAYOUTS[layout], *args.overrides]
            tiny = {f: harness.summarize([train_once(work, [*base, *model_sets(TINY[f], weights)], need=0)
                                          for _ in range(args.tiny_repeats or args.repeats)]) for f in families}
            for name in args.models:
                overrides = [*base, *model_sets(name, weights)]
                prediction = predicted(overrides, data)
                # before: every worker also holds the whole model
                need = int(prediction["total_bytes"] + prediction["workers"] * (prediction["model_mib"] + 700) * 2**20)
                sides = {side: (lambda extra=SIDES[side]: train_once(work, [*overrides, *extra], need))
                         for side in SIDES if not (args.after_only and side == "before")}
                runs = harness.alternate(sides, args.repeats)
                row = analyse(name, layout, {s: harness.summarize(r) for s, r in runs.items()}, tiny[family(name)],
                              prediction)
                print(report(row), flush=True)
                rows.append(row)
                session.write(rows=rows, targets=targets(rows), note=NOTE)   # partial results survive a stop
    finally:
        shutil.rmtree(work, ignore_errors=True)
    met = targets(rows)
    for name, t in met.items():
        print(f"[bench] target {name}: worst {t['worst']} vs {t['target']}: "
              f"{'met' if t['met'] else 'NOT met' if t['met'] is not None else 'not measured'}")
    session.write(rows=rows, targets=met, note=NOTE)
    return 0


NOTE = ("Peaks are RSS high-water marks (MiB) of each Ray Train worker; build_mib = after build+load minus at the "
        "worker's start; load_mib (after side) = the same peak minus the RSS once the model is built on meta (its "
        "library imported, no storage): layout, materialization and load; run_above_tiny_mib = whole-run peak minus the same layout's tiny-model run of the same library (gpt 2x64; an HF Llama 2x64 for Llamas). "
        "Timings ran on a shared 2-core machine with other work: noisy.")

