"""raydl report: a run's or a sweep's summary as a table, and report.png of its curves."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("report", help="Print a run's (or each sweep trial's) summary as a table and draw report.png: "
                       "loss, throughput, data wait, memory, cost and workers against steps.", description=__doc__)
    p.add_argument("source", metavar="RUN_OR_SWEEP", help="A run directory (runs/<run>, holding metrics.jsonl) or a "
                   "sweep directory (runs/<sweep>, holding sweep.yaml): one line and one curve per trial.")
    p.add_argument("--out", help="Where to write the PNG (default: report.png in RUN_OR_SWEEP).")
    p.set_defaults(func=run)


def run(args) -> int:
    from raydl import report

    source = report.load(args.source)
    print(report.summary_table(source), flush=True)   # the table even where matplotlib is missing
    log.info(f"wrote {report.write_png(source, args.out)}")
    return 0
