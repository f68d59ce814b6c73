"""raydl report: a run's or a sweep's summary as a table, and report.png of its curves."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("report", help="Print a run's (or each sweep trial's) summary as a table and draw report.png: "
                       "loss, throughput, data wait, memory, cost and workers against steps.", description=__doc__)
    p.add_argument("source", metavar="RUN_OR_SWEEP", help="A run directory (runs/<run>, holding metrics.jsonl) or a "
                   "sweep directory (runs/<sweep>, holding sweep.yaml): one line and one curve per trial. A path or "
                   "a URI (s3://, gs://, ...).")
    p.add_argument("--out", help="Where to write the PNG, a path or a URI (default: report.png in RUN_OR_SWEEP).")
    p.set_defaults(func=run)


def run(args) -> int:
    import pyarrow.fs as pafs

    from raydl import report, storage
    from raydl.report.source import READS

    # A run or sweep in a bucket: only the files a report reads are downloaded (not its checkpoints).
    with storage.local_copy(args.source, "report source", only=READS) as local:
        source = report.load(local)
        print(report.summary_table(source), flush=True)   # the table even where matplotlib is missing
        out = args.out or storage.join(args.source, report.PNG)
        fs, path = storage.resolve(out, "--out")
        if isinstance(fs, pafs.LocalFileSystem):
            log.info(f"wrote {report.write_png(source, path)}")
            return 0
        with open(report.write_png(source, os.path.join(local, report.PNG)), "rb") as png:
            storage.write_bytes(fs, path, png.read())
        log.info(f"wrote {out}")
    return 0
