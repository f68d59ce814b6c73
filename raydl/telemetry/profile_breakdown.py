"""Where a profiled step's time goes: a torch.profiler Chrome trace -> one figure per part of the step.

Pure (no torch): the events are the `traceEvents` of a trace file, timestamps in µs. Every instant
of a step counts once, for the first of these that holds there:

    send_recv    a pipeline send/recv op (c10d::send, c10d::recv_) on the step's thread
    collective   a collective op (any other c10d:: op) on the step's thread, or the thread blocked
                 while a collective runs on a communication thread (gloo works there; the exposed wait)
    data_wait    raydl's data_wait range (next batch from the loader)
    optimizer    raydl's optimizer range (unscale, clip, step, zero_grad)
    forward      raydl's forward range (data parallel: model and loss of a micro-batch)
    backward     raydl's backward range (data parallel: loss.backward())
    in raydl's forward_backward range outside those (the pipeline schedule's step, which is torch's code):
      backward   an autograd engine function
      forward    any other op
      bubble     no op: the rank waits for a peer's activations or gradients (pp > 1)
    other        the rest of the step (loop bookkeeping; with pp = 1 also uncovered time in forward_backward)

A wait for a pipeline peer is idle time, so it is bubble, wire time included; send_recv is the time
spent in the send/recv calls themselves. On a GPU these are host-side times (kernels run
asynchronously; the host waits where the step synchronises), beside the device time of the top kernels.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

PARTS = ("forward", "backward", "collective", "send_recv", "bubble", "optimizer", "data_wait", "other")
RANGE_PREFIX = "raydl."
STEP_RANGE = "raydl.step"
PHASES = ("data_wait", "forward_backward", "forward", "backward", "optimizer")

P2P_OPS = frozenset({"c10d::send", "c10d::recv_", "c10d::recv_any_source_"})
AUTOGRAD_PREFIX = "autograd::engine::evaluate_function"
COMM_SPAN_PREFIXES = ("gloo:", "nccl:")   # spans of communication work, started or run on another thread
P2P_SPAN_NAMES = ("send", "recv")

Event = dict[str, Any]


def kinds_of(event: Event, main_tid: Any) -> list[str]:
    """The interval kinds one trace event contributes to the sweep (usually none or one)."""
    name, cat, on_main = event.get("name", ""), event.get("cat"), event.get("tid") == main_tid
    if name.startswith(AUTOGRAD_PREFIX):   # any thread: on GPU the autograd engine runs on its own
        return ["autograd", "compute"] if on_main else ["autograd"]
    if not on_main:
        is_p2p = name.split(":", 1)[-1].startswith(P2P_SPAN_NAMES)
        return ["comm_thread"] if name.startswith(COMM_SPAN_PREFIXES) and not is_p2p else []
    if name.startswith(RANGE_PREFIX) and name[len(RANGE_PREFIX):] in PHASES:
        return [name[len(RANGE_PREFIX):]]
    if name in P2P_OPS:
        return ["p2p"]
    if name.startswith("c10d::"):
        return ["collective"]
    return ["compute"] if cat == "cpu_op" else []


def label(held: Counter, pipelined: bool) -> str:
    """The part an instant belongs to, from the interval kinds that hold there."""
    if held["p2p"]:
        return "send_recv"
    if held["collective"] or (held["comm_thread"] and not held["compute"] and not held["data_wait"]):
        return "collective"
    for phase in ("data_wait", "optimizer", "forward", "backward"):
        if held[phase]:
            return phase
    if held["forward_backward"]:
        if held["autograd"]:
            return "backward"
        if held["compute"]:
            return "forward"
        return "bubble" if pipelined else "other"
    return "other"


def attribute(events: Iterable[Event], start: float, end: float, *, main_tid: Any, pipelined: bool) -> dict[str, float]:
    """Seconds of each part in the window [start, end] (µs); they add up to the window's length."""
    edges: list[tuple[float, int, str]] = []
    for e in events:
        lo, hi = max(e["ts"], start), min(e["ts"] + e.get("dur", 0.0), end)
        if hi > lo:
            for kind in kinds_of(e, main_tid):
                edges += [(lo, 1, kind), (hi, -1, kind)]
    edges.sort(key=lambda edge: edge[0])
    parts, held, now = dict.fromkeys(PARTS, 0.0), Counter(), start
    for t, delta, kind in edges:
        if t > now:
            parts[label(held, pipelined)] += (t - now) / 1e6
            now = t
        held[kind] += delta
    parts[label(held, pipelined)] += (end - now) / 1e6
    return parts


def step_windows(events: list[Event]) -> list[Event]:
    """raydl's step ranges on the CPU, in order (on CUDA the profiler also draws each range on the GPU's
    timeline, as a gpu_user_annotation spanning the kernels it launched)."""
    return sorted((e for e in events if e.get("name") == STEP_RANGE and e.get("ph") == "X"
                   and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])


def top_ops(events: list[Event], windows: list[Event], *, count: int = 8) -> list[dict[str, Any]]:
    """The ops with the most self time inside the windows on the windows' thread: name, seconds and calls per step."""
    main_tid, spans = windows[0]["tid"], [(w["ts"], w["ts"] + w["dur"]) for w in windows]
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("tid") == main_tid
           and any(lo <= e["ts"] < hi for lo, hi in spans)]
    self_us, calls = self_times(ops), Counter(e["name"] for e in ops)
    ranked = sorted(self_us.items(), key=lambda kv: -kv[1])[:count]
    return [{"name": name, "self_s": us / 1e6 / len(windows), "calls": calls[name] / len(windows)}
            for name, us in ranked]


def top_kernels(events: list[Event], windows: list[Event], *, count: int = 8) -> list[dict[str, Any]]:
    """GPU kernels with the most device time that started inside the windows (empty on CPU)."""
    lo, hi = windows[0]["ts"], windows[-1]["ts"] + windows[-1]["dur"]
    total: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "kernel" and lo <= e["ts"] < hi:
            total[e["name"]] += e.get("dur", 0.0)
    ranked = sorted(total.items(), key=lambda kv: -kv[1])[:count]
    return [{"name": name, "device_s": us / 1e6 / len(windows)} for name, us in ranked]


def self_times(ops: list[Event]) -> dict[str, float]:
    """µs per op name, less the time of the ops nested in it (one thread's properly nested ops)."""
    out: dict[str, float] = defaultdict(float)
    stack: list[Event] = []
    for e in sorted(ops, key=lambda e: (e["ts"], -e.get("dur", 0.0))):
        while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
            stack.pop()
        out[e["name"]] += e["dur"]
        if stack:
            out[stack[-1]["name"]] -= e["dur"]
        stack.append(e)
    return out


def rank_breakdown(events: list[Event], step_s: list[float], *, pipelined: bool) -> dict[str, Any]:
    """One rank's figures, means over its profiled steps: measured step time, parts, top ops and kernels."""
    windows = step_windows(events)
    if len(windows) != len(step_s):
        raise ValueError(f"the trace holds {len(windows)} {STEP_RANGE} ranges for {len(step_s)} profiled steps")
    main_tid = windows[0]["tid"]
    relevant = [e for e in events if e.get("ph") == "X" and "ts" in e]
    per_step = [attribute(relevant, w["ts"], w["ts"] + w["dur"], main_tid=main_tid, pipelined=pipelined)
                for w in windows]
    return {"step_s": sum(step_s) / len(step_s),
            "parts": {p: sum(s[p] for s in per_step) / len(per_step) for p in PARTS},
            "top_ops": top_ops(relevant, windows), "top_kernels": top_kernels(relevant, windows)}


HEADINGS = {"forward": "forward", "backward": "backward", "collective": "collective", "send_recv": "send/recv",
            "bubble": "bubble", "optimizer": "optimizer", "data_wait": "data wait", "other": "other"}


def format_table(breakdown: dict[str, Any]) -> str:
    """The breakdown as printed: a row per rank in ms per step, then each rank's top ops."""
    first, last = breakdown["steps"]
    lines = [(f"[raydl] profile of steps {first}-{last}: ms per step, mean over {last - first + 1} steps "
              f"(traces: {breakdown['dir']}/rank<r>.json; open in https://ui.perfetto.dev or chrome://tracing)"),
             f"{'rank':>4} {'dp':>3} {'pp':>3} {'step':>8} " + " ".join(f"{HEADINGS[p]:>10}" for p in PARTS)]
    for r in breakdown["ranks"]:
        cells = " ".join(f"{r['parts'][p] * 1e3:>10.1f}" for p in PARTS)
        lines.append(f"{r['rank']:>4} {r['dp_rank']:>3} {r['pp_rank']:>3} {r['step_s'] * 1e3:>8.1f} {cells}")
    for r in breakdown["ranks"]:
        ops = ", ".join(f"{op['name']} {op['self_s'] * 1e3:.1f}" for op in r["top_ops"][:5])
        lines.append(f"[raydl] rank {r['rank']} top ops by self time (ms per step): {ops}")
        if r["top_kernels"]:
            kernels = ", ".join(f"{k['name'][:60]} {k['device_s'] * 1e3:.1f}" for k in r["top_kernels"][:5])
            lines.append(f"[raydl] rank {r['rank']} top GPU kernels (ms per step): {kernels}")
    return "\n".join(lines)
