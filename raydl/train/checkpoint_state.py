"""raydl_state.json, the trainer state of a checkpoint: its schema, and the checks an edited or
damaged one fails (it comes from disk, perhaps from elsewhere, and decides where training resumes)."""

from __future__ import annotations

import json
import math
from typing import Any

FORMAT = 1


def _count(value: Any, minimum: int = 0) -> bool:
    return type(value) is int and value >= minimum   # not bool, not float


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


# GradScaler.state_dict() of an enabled scaler; a disabled one saves {}.
SCALER_KEYS = {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}

# Every field of raydl_state.json: (check, what it must be).
STATE_SCHEMA = {
    "format": (lambda v: v == FORMAT, f"must be {FORMAT}"),
    "step": (_count, "must be an integer >= 0"),
    "samples": (_count, "must be an integer >= 0"),
    "position": (lambda v: isinstance(v, dict) and v.keys() == {"epoch", "offset"} and all(map(_count, v.values())),
                 "must be {\"epoch\": int >= 0, \"offset\": int >= 0}"),
    "model": (lambda v: isinstance(v, dict) and all(type(x) in (str, int) for x in v.values()),
              "must be the model fingerprint (a mapping of names and numbers)"),
    "layout": (lambda v: isinstance(v, dict) and _count(v.get("world_size"), 1), "must be a layout with world_size >= 1"),
    "scaler": (lambda v: v is None or v == {} or (isinstance(v, dict) and v.keys() == SCALER_KEYS
                                                    and all(map(_finite, v.values()))),
               f"must be null or a GradScaler state ({sorted(SCALER_KEYS)}, finite numbers)"),
    "lr": (lambda v: _finite(v) and v >= 0, "must be a finite number >= 0"),
    "saved_by_ranks": (lambda v: _count(v, 1), "must be an integer >= 1"),
}


def state_problem(state: Any) -> str | None:
    """None if `state` (a parsed raydl_state.json) fits the schema and agrees with itself, else what is wrong."""
    if not isinstance(state, dict):
        return f"is {type(state).__name__}, not a JSON object"
    missing, unknown = STATE_SCHEMA.keys() - state.keys(), state.keys() - STATE_SCHEMA.keys()
    if missing or unknown:
        return f"lacks fields {sorted(missing)}" if missing else f"has unknown fields {sorted(unknown)[:5]}"
    for key, (valid, rule) in STATE_SCHEMA.items():
        if not valid(state[key]):
            return f"field '{key}' is {json.dumps(state[key])[:100]}: it {rule}"
    # Every step consumes at least one sample, and the epoch's offset counts samples of this epoch only.
    if state["samples"] < max(state["step"], state["position"]["offset"]):
        return (f"field 'samples' is {state['samples']}, fewer than its step ({state['step']}) or data offset "
                f"({state['position']['offset']})")
    savers = saving_ranks(state["layout"])
    if state["saved_by_ranks"] != savers:
        return (f"field 'saved_by_ranks' is {state['saved_by_ranks']} but its layout has {savers} saving "
                f"rank{'s' if savers > 1 else ''}")
    return None


def saving_ranks(layout: dict[str, Any]) -> int:
    """The ranks that write a checkpoint of `layout` (a Layout.to_dict()): every rank its part, but on the survivors
    path (dp_wrapper torchft), where every replica holds the whole state and one writes it."""
    return 1 if layout.get("dp_wrapper") == "torchft" else layout["world_size"]
