"""Benchmarks, run as `raydl bench NAME [args]`; each NAME is a module here with main(argv) -> int whose
docstring's first line describes it. The other modules are their parts (harness.py: what all share)."""

BENCHMARKS = ("checkpoint", "first_step", "gpu", "gpu_memory", "gpu_vs_nanogpt", "host_memory", "ingest", "loss_memory",
              "lora_memory", "memory", "memory_overhead", "overhead", "packing", "pipeline", "plan_check", "recovery",
              "scaling", "startup", "sweep")
