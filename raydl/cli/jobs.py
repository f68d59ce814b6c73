"""raydl jobs: list, inspect, follow and stop Ray jobs (any job, not only raydl's).

    raydl jobs list | status ID | logs ID [--follow] | stop ID   [--address URL] [--token-file F]

`status` exits 0 for a running or succeeded job and 1 for a failed or stopped one; `logs --follow`
streams until the job ends and exits with its status (0 SUCCEEDED, 1 FAILED/STOPPED).
"""

from __future__ import annotations

import argparse
import datetime as dt

from raydl import jobs
from raydl.cli.submit import add_connection_args, connect, say


def register(sub) -> None:
    p = sub.add_parser("jobs", help="List, inspect, follow or stop Ray jobs.", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, func, help_text in (("list", run_list, "All jobs, newest last."),
                                  ("status", run_status, "Status, message and times of one job."),
                                  ("logs", run_logs, "The job's logs so far (or --follow them)."),
                                  ("stop", run_stop, "Stop a job and wait until it has stopped.")):
        a = actions.add_parser(name, help=help_text, description=help_text)
        add_connection_args(a)
        if name != "list":
            a.add_argument("job_id", metavar="ID", help="Submission id (raysubmit_...) as printed by raydl submit.")
        if name == "logs":
            a.add_argument("--follow", action="store_true", help="Stream until the job ends.")
        a.set_defaults(func=func)


def _time(ms: int | None) -> str:
    return dt.datetime.fromtimestamp(ms / 1000).strftime("%Y-%m-%d %H:%M:%S") if ms else "-"


def run_list(args) -> int:
    rows = sorted(connect(args).list(), key=lambda j: j.start_time or 0)
    print(f"{'ID':<28} {'STATUS':<10} {'STARTED':<19}  ENTRYPOINT")
    for j in rows:
        print(f"{j.submission_id or j.job_id:<28} {j.status.value:<10} {_time(j.start_time):<19}  {j.entrypoint}")
    return 0


def run_status(args) -> int:
    info = connect(args).info(args.job_id)
    status = info.status.value
    print(f"{args.job_id}: {status}\n  entrypoint: {info.entrypoint}\n  started: {_time(info.start_time)}"
          f"  ended: {_time(info.end_time)}\n  message: {info.message or '-'}")
    return jobs.exit_code(status) if status in {"FAILED", "STOPPED"} else 0


def run_logs(args) -> int:
    client = connect(args)
    if args.follow:
        status = client.follow(args.job_id)
        say(f"job {args.job_id} {status}")
        return jobs.exit_code(status)
    print(client.logs(args.job_id), end="")
    return 0


def run_stop(args) -> int:
    client = connect(args)
    status = client.status(args.job_id)
    if status in jobs.TERMINAL:
        say(f"job {args.job_id} already {status}; nothing to stop")
        return 0
    client.stop(args.job_id)
    say(f"job {args.job_id} {client.wait(args.job_id, jobs.TERMINAL, timeout_s=60)}")
    return 0
