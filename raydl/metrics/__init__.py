"""Step records on their way to files: the writer (metrics.jsonl, progress, summary.json, TensorBoard events)
and the sink actor that carries rank 0's records to it under Ray. Shared by both launchers; below
`raydl/driver` and `raydl/train`, importing neither."""
