"""User-facing errors: each says what is wrong, with the numbers, and how to fix it.

The CLI turns any `RaydlError` into one paragraph on stderr and exit code 2; a bare
traceback means a bug in raydl, not in the user's input.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

from raydl import commands

# Who prints the next error's paragraph in this process's place: raydl.driver.cluster_watch's child, which outlives
# Ray's _Exit of the driver once its raylet is gone (a paragraph printed here, then _Exit before the child heard of it,
# was said twice: CI, 2026-12-06). Each takes the paragraph and returns whether it printed it. Emptied as they are
# asked, so a process that runs many commands (tests, a sweep's driver) keeps none.
_SPEAKERS: list[Callable[[str], bool]] = []


def one_line(error: BaseException) -> str:
    """A library's error message on one line (Arrow's and Ray's run over several), for a one-paragraph error."""
    return " ".join(str(error).split())


def speak_through(speaker: Callable[[str], bool]) -> None:
    _SPEAKERS.append(speaker)


def say(error: RaydlError) -> int:
    """Print the error's one paragraph on stderr (or have a speaker print it); its exit code."""
    paragraph = f"raydl: error: {error}"
    speakers, _SPEAKERS[:] = list(_SPEAKERS), []
    sys.stdout.flush()   # what the run printed before comes before the paragraph, whoever prints it
    printed = [speak(paragraph) for speak in speakers]   # every speaker is told: each waits for a word
    if not any(printed):
        print(paragraph, file=sys.stderr, flush=True)
    return error.exit_code


class RaydlError(Exception):
    """An error in the user's input (config, data, checkpoint, CLI); exit code 2.

    `log_file`: where the tracebacks of the workers that raised it went (set by the driver that caught it);
    the paragraph names it."""

    exit_code = 2
    log_file: str | None = None

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text} The workers' tracebacks are in {self.log_file}." if self.log_file else text


class ConfigError(RaydlError, ValueError):
    def __init__(self, path: str, problem: str, fix: str):
        self.path, self.problem, self.fix = path, problem, fix
        super().__init__(f"config field '{path}' {problem}. Fix: {fix}.")

    def __reduce__(self):   # errors raised in Ray workers travel pickled to the driver
        return (type(self), (self.path, self.problem, self.fix))


class DataError(RaydlError, ValueError):
    """Bad dataset: missing, empty, not parquet, wrong schema, corrupt shard."""


class CheckpointError(RaydlError, ValueError):
    """A checkpoint that cannot be used: unreadable, incomplete or from another model."""


class LayoutError(RaydlError, ValueError):
    """A parallel layout that cannot run on this world size or model."""


class TrainingDivergedError(RaydlError, FloatingPointError):
    """The loss became non-finite. Not bad input, and a restart would only diverge again: exit 1, no retry."""

    exit_code = 1

    def __init__(self, *, step: int, loss: float, lr: float, last_finite: tuple[int, float] | None,
                 checkpoint_step: int, run_dir: str, grad_clip: float, precision: str):
        self.fields = dict(step=step, loss=loss, lr=lr, last_finite=last_finite, checkpoint_step=checkpoint_step,
                           run_dir=run_dir, grad_clip=grad_clip, precision=precision)
        before = (f"the last finite loss was {last_finite[1]:.4f} at step {last_finite[0]}" if last_finite
                  else "no step of this worker group had a finite loss")
        kept = (f"The checkpoint at step {checkpoint_step} is kept: resume from it with "
                f"`{commands.resume_run(run_dir)}` after changing the config with --set" if checkpoint_step
                else "No checkpoint was saved before it")
        tries = [f"lower train.lr (now {lr:.3g} at this step)", "raise train.warmup_steps",
                 f"clip gradients harder with train.grad_clip (now {grad_clip:g})" if grad_clip
                 else "clip gradients with train.grad_clip=1.0"]
        if precision == "fp16":
            tries.append("use train.precision=bf16 instead of fp16 (fp16 overflows)")
        super().__init__(f"training diverged at step {step}: the loss is {loss} ({before}). {kept}. "
                         f"Fix: {'; or '.join(tries)}.")

    def __reduce__(self):   # errors raised in Ray workers travel pickled to the driver
        return (_rebuild_diverged, (self.fields,))


def _rebuild_diverged(fields: dict) -> TrainingDivergedError:
    return TrainingDivergedError(**fields)


class OutOfMemory(RaydlError, MemoryError):
    """A worker could not allocate what its layout needs. Not bad input, and a restart of the same layout would only
    fail again: exit 1, no retry."""

    exit_code = 1

    def __reduce__(self):   # errors raised in Ray workers travel pickled to the driver
        return (type(self), self.args)


def is_out_of_memory(error: BaseException) -> bool:
    """torch's allocation failures: the CPU allocator's RuntimeError, CUDA's OutOfMemoryError; and Python's own."""
    return (isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"
            or (isinstance(error, RuntimeError) and "can't allocate memory" in str(error)))


def out_of_memory(error: BaseException, *, rank: int, during: str, limit_mb: int = 0) -> OutOfMemory:
    """The paragraph for a worker's allocation failure `error`, with what to change."""
    where = "GPU" if type(error).__name__ == "OutOfMemoryError" else "host"
    asked = re.search(r"you tried to allocate (\d+) bytes", str(error))   # the CPU allocator's words
    what = f"an allocation of {int(asked.group(1)) / 2**20:,.1f} MiB failed" if asked else one_line(error)[:240]
    cap = (f" Each worker may allocate {limit_mb} MiB beyond what it held when its build started "
           f"(debug.memory_limit_mb)." if limit_mb else "")
    return OutOfMemory(
        f"worker {rank} ran out of {where} memory while {during}: {what}.{cap} Fix: a layout that "
        f"holds less per worker (parallel.dp_wrapper=fsdp shards weights, gradients and optimizer state; "
        f"parallel.pp_degree splits the layers), train.optimizer_in_backward=true, a smaller train.micro_batch_size "
        f"or model.activation_checkpointing=true, or workers with more memory; the refusal before a run starts "
        f"predicts each worker's peak (docs/memory.md).")


class RunFailed(RaydlError):
    """The worker group failed more often than scaling.max_failures allows: not bad input, exit 1; the paragraph
    names the cause and the command that resumes the run from its newest checkpoint."""

    exit_code = 1


class ClusterLost(RaydlError):
    """The Ray cluster a run depends on went away mid-run: nothing wrong with the input, exit 1."""

    exit_code = 1


def raydl_error_in(error: BaseException | None) -> RaydlError | None:
    """The RaydlError a worker raised, out of Ray's wrappers (WorkerGroupError, RayTaskError, causes)."""
    import sys

    ray_exceptions = sys.modules.get("ray.exceptions")   # only Ray's wrappers need it: loaded wherever they exist
    seen, todo = set(), [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if ray_exceptions and isinstance(e, ray_exceptions.RayTaskError):   # also its cause's class; str() is Ray's traceback
            todo.append(e.cause)
            continue
        if isinstance(e, RaydlError):
            return e
        todo.extend([e.__cause__, e.__context__, *getattr(e, "worker_failures", {}).values()])
    return None
