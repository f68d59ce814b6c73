"""The table `raydl plan --cluster` prints: one row per (node type, node count) with its fastest layout,
the cheapest plan within the deadline marked c, the fastest within the budget marked f."""

from __future__ import annotations

from raydl.parallel import search
from raydl.parallel.cluster_plan import ClusterPlan, Prediction
from raydl.telemetry.cost import format_usd

def format_plan(plan: ClusterPlan, *, steps: int, deadline_s: float | None, budget_usd: float | None) -> str:
    header = ("", "node type", "machine", "spot", "nodes", "workers", "layout", "wrapper", "step ms", "optim ms",
              "dp comm ms", "wall h", "cost")
    rows = [header] + [_plan_row(p, plan) for p in plan.predictions]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    cheapest = "cheapest" + ("" if deadline_s is None else f" within the deadline ({deadline_s / 3600:g} h)")
    fastest = "fastest" + ("" if budget_usd is None else f" within the budget (${budget_usd:g})")
    lines += [f"{len(plan.predictions)} (node type, node count) pairs, {plan.layouts_evaluated} layouts evaluated, "
              f"{steps} steps", f"c = {_verdict(cheapest, plan.cheapest)}", f"f = {_verdict(fastest, plan.fastest)}"]
    lines += [f"ruled out: {why}" for why in plan.ruled_out]
    return "\n".join(lines)


def _plan_row(p: Prediction, plan: ClusterPlan) -> tuple[str, ...]:
    c, t = p.candidate, p.node_type
    mark = ("c" if p is plan.cheapest else "") + ("f" if p is plan.fastest else "")
    return (mark, t.name, t.machine, "yes" if t.spot else "no", str(p.nodes), str(p.workers), search.describe(c),
            p.dp_wrapper, f"{1e3 * p.step_s:.1f}", f"{1e3 * p.optimizer_s:.1f}", f"{1e3 * p.comm_s:.1f}",
            f"{p.wall_s / 3600:.2f}", format_usd(p.usd))


def _verdict(label: str, p: Prediction | None) -> str:
    if p is None:
        return f"{label}: none (no priced plan meets it)"
    return (f"{label}: {p.nodes} x {p.node_type.name} ({p.node_type.machine}), {search.describe(p.candidate)}, "
            f"{p.wall_s / 3600:.2f} h, {format_usd(p.usd)}")
