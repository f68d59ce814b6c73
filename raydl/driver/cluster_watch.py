"""Say that the cluster is gone, even when Ray ends this process without a word.

When the node this driver runs on loses its raylet (a joined cluster's head stopped, with the driver on
it), Ray's core worker terminates the process as soon as it next touches the object store ("The
connection to the plasma store is failed. Terminate the process.": `_Exit(1)`, logged at WARNING, so
nothing reaches the console). No handler in this process can run after that. Two watchers:

- a thread here polls the local raylet's port; once it has stopped answering for GONE_AFTER_S (one probe that
  times out is a busy machine, not a lost raylet: a fault test's healthy run was ended by one at load ~10), the
  run cannot go on, so it prints raydl's one-paragraph error (the checkpoint and the resume command) and exits
  with code 1;
- a small child process (`python -m raydl.driver.cluster_watch`) holds a pipe from this process. If the
  pipe closes without this process having said "done" or handed it a paragraph (Ray's `_Exit` won the race
  with the thread), and the raylet then stops answering, the child prints the same paragraph on the stderr
  both share. The exit code, 1, is Ray's already. Signals sent to the group (Ctrl-C, a job stop) do not stop
  the child: it ends when the pipe closes.

A run that ends in an error, and the thread, hand their paragraph to the child, which prints it; this process
waits for that. Printed here, and then told, a paragraph could be said twice: once the raylet is gone, Ray's core
worker may `_Exit` this process between the two (CI printed the controller's paragraph and then the child's, twice
on 2026-12-06, the second time with the telling a few microseconds after the print). Handed over in one write, it
is printed once whenever the `_Exit` comes.

The thread and the run's end take one lock: once the run has ended (its error is the CLI's to say), the thread
says nothing.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from raydl import commands
from raydl.errors import speak_through

POLL_S = 0.1   # a race with the core worker's own exit (see above): a local TCP connect costs ~0.1 ms
PROBE_TIMEOUT_S = 1.0
SETTLE_S = 5.0   # after the driver's silent exit, how long its raylet has to stop answering to count as gone
GONE_AFTER_S = 3.0   # while the driver lives, how long its raylet must fail every probe to count as gone
DONE, SAY = b"done\n", b"say "   # SAY, then the paragraph: the child prints it
CAUSE = "this machine's raylet stopped answering"


def raylet_answers(node: dict, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the raylet of `node` (a ray.nodes() entry) accepts a TCP connection now: a vanished node's
    port refuses or times out at once, while the GCS may list it alive for another 16 s."""
    try:
        with socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=timeout_s):
            return True
    except OSError:
        return False


def cluster_lost_message(run_dir: str, address: str | None, cause: str) -> str:
    from raydl.driver.run_location import checkpoints_location
    from raydl.train import checkpoint as ckpt

    where = f"the Ray cluster at {address}" if address else "this process's local Ray"
    latest = ckpt.find_latest(checkpoints_location(run_dir))
    saved = f"the last checkpoint is {latest}" if latest else "no checkpoint was saved in the run directory"
    # The address of a cluster that went away is not printed in the command: a new one may answer elsewhere.
    on = " on a local Ray, or add --address of the cluster once it is back" if address else ""
    return (f"{where} went away during the run: {cause}. {saved.capitalize()}. Fix: bring the cluster back "
            f"(`ray status` on its head tells) and resume with `{commands.resume_run(run_dir)}`{on}.")


class ClusterWatch:
    def __init__(self, run_dir: str, address: str | None, exit_code: int):
        self.run_dir, self.address, self.exit_code = run_dir, address, exit_code
        self._stop = threading.Event()
        self._ending = threading.Lock()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="raydl-raylet-watch")

    def __enter__(self) -> "ClusterWatch":
        import ray

        here = ray.get_runtime_context().get_node_id()
        return self.start(next(node for node in ray.nodes() if node["NodeID"] == here))

    def start(self, node: dict) -> "ClusterWatch":
        """Watch `node`'s raylet (a ray.nodes() entry: the one this driver runs on)."""
        self.node = node
        self._child = subprocess.Popen(
            [sys.executable, "-m", "raydl.driver.cluster_watch", self.node["NodeManagerAddress"],
             str(self.node["NodeManagerPort"]), self.run_dir, self.address or ""], stdin=subprocess.PIPE)
        self._thread.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        with self._ending:
            self._stop.set()
        if exc_type is None:
            self._tell(DONE)
            self._child.wait(timeout=30)
        else:   # the error is said by the caller (raydl's CLI) after this; a traceback's at exit
            speak_through(self._say_through_child)
            atexit.register(self._tell, DONE)

    def _tell(self, word: bytes) -> bool:
        try:
            self._child.stdin.write(word)
            self._child.stdin.close()
            return True
        except (OSError, ValueError):   # already told, or the child is gone: nothing left to say
            return False

    def _say_through_child(self, paragraph: str) -> bool:
        """Whether the child printed `paragraph` on the stderr both share (only when this process's stderr is it)."""
        try:
            shared = sys.stderr.fileno() == 2
        except (AttributeError, OSError, ValueError):   # captured (pytest's capsys): printed here, where it is read
            shared = False
        if not (shared and self._tell(SAY + paragraph.encode() + b"\n")):
            return False
        try:
            return self._child.wait(timeout=30) == 0
        except subprocess.TimeoutExpired:
            return False

    def _watch(self) -> None:
        self._message()   # once now: whatever it imports is loaded before the race it is for
        silent_since = None
        while not self._stop.wait(POLL_S):
            if raylet_answers(self.node):
                silent_since = None
                continue
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since >= GONE_AFTER_S:
                with self._ending:
                    if self._stop.is_set():   # the run ended meanwhile: its own error says why
                        return
                    paragraph = f"raydl: error: {self._message()}"
                    if not self._say_through_child(paragraph):
                        print(paragraph, file=sys.stderr, flush=True)
                    os._exit(self.exit_code)

    def _message(self) -> str:
        return cluster_lost_message(self.run_dir, self.address, CAUSE)


def main(host: str, port: str, run_dir: str, address: str) -> int:
    """The child: wait for the driver's pipe to close; print the paragraph it handed over, or, if the driver left
    without a word and its raylet is gone, say so."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    told = sys.stdin.buffer.read()
    if told.startswith(SAY):
        sys.stderr.buffer.write(told[len(SAY):])
        sys.stderr.flush()
        return 0
    if told == DONE:
        return 0
    node = {"NodeManagerAddress": host, "NodeManagerPort": int(port)}
    deadline = time.monotonic() + SETTLE_S
    while raylet_answers(node):   # killed for another reason (kill -9, out of memory): not this paragraph
        if time.monotonic() > deadline:
            return 0
        time.sleep(POLL_S)
    print(f"raydl: error: {cluster_lost_message(run_dir, address or None, CAUSE)}",
          file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
