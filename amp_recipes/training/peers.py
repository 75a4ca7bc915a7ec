"""A rank that died or failed ends the other ranks of a multi-process run within seconds, with one
sentence, also where they wait for it in a collective that never completes.

Under NCCL a rank whose peer is gone waits in a collective that does not fail: the GPU spins, the
main thread is blocked in CUDA (with the GIL released), and Python runs no signal handler until
that call returns. torchrun's agent sends the ranks on the dead one's machine SIGTERM, which the
preemption handler could only note, and SIGKILL 30 s later; ranks on other machines wait for
NCCL's own error (a broken connection) or its watchdog (--ddp_timeout), which ends the process from
its own C++ thread (SIGABRT; by torch's source, about 60 s after the timeout). Neither leaves an
`error:` sentence, and neither is a preemption. Under gloo (CPU runs) a collective fails at once
instead, and the main thread says why (errors.lost_rank_message).

`PeerWatch` is a daemon thread in each process of a multi-process run, from the run's start until
its last collective. Once a second it looks:
- at the other ranks on this machine, through the process ids every rank registers in torchrun's
  agent store: one whose process is gone ended without our doing (a signal: the kernel's
  out-of-memory killer, kill -9, a crash) unless it said how it ended (errors.mark_end: finished,
  stopped by a preemption, failed with its own error, or gave up on a peer);
- in the store, for a rank lost on another machine (`lost`, written by the ranks that saw it go)
  or one that failed with its own error (`failed`);
- under NCCL, at the process group's own error: its watchdog's timeout, a broken connection.
Then it gives the main thread GRACE_S to end by itself (gloo's errors do), and if it has not, it
prints one sentence for the whole launch (errors.first_to_say), releases the output folder's lock,
says it gave up (so that no one takes it for a death) and ends the process with exit code 1.
Checkpoints and the final model are written aside and renamed when complete, so ending a process
at any moment leaves none half-written.

What it cannot see: a whole machine gone (no rank is left on it to say so; the others wait for
NCCL's error or timeout), a rank that hangs (the others give up after --ddp_timeout), a rank that
dies before it registered (before its run's output folder is claimed), and launches without
torchrun's agent store (then only NCCL's own error is read).
"""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from amp_recipes import errors
from amp_recipes.training import outputs

POLL_S = 1.0  # how often the watch looks
GRACE_S = 3.0  # how long the main thread gets to end by itself once something is wrong
ENDED_ON_PURPOSE = ("finished", "stopped", "gave_up", "lost")  # a peer that said so did not die


def machine() -> str | None:
    """Where this process's pids mean something, as "host/boot id/pid namespace": a machine's
    boot, and the pid namespace the ranks share there (containers on one host see each other's
    pids only when they share it). None where /proc does not show this very process (another
    system, or a /proc of another namespace): then no pid is judged."""
    try:
        if int(Path("/proc/self/stat").read_text().split(" ", 1)[0]) != os.getpid():
            return None
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except (OSError, ValueError):
        return None
    return f"{socket.gethostname()}/{boot}/{namespace}"


def process_start(pid: int) -> str | None:
    """The process's start time (/proc/<pid>/stat's 22nd field), None once it is gone or a zombie
    (exited, its parent not having collected it yet): a pid reused by another process starts at
    another time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def died_message(rank: int, world: int, where: str) -> str:
    return (
        f"rank {rank} of {world} ({where}) ended without an error of its own (a signal killed it: the kernel's "
        "out-of-memory killer, kill -9, a crash), and the other ranks cannot go on without it, so the launcher "
        "stops every process: resume with --resume_from_checkpoint latest."
    )


def failed_message(world: int) -> str:
    return (
        f"another of the {world} ranks failed with an error of its own (above, or in its machine's log) "
        "while the others waited for it in a collective operation, and the launcher stops every process: "
        "fix that error, then resume with --resume_from_checkpoint latest."
    )


def nccl_message(error: str, world: int, ddp_timeout_s: int) -> str:
    """NCCL's own error, in words; the same sentence on every rank, so that it is printed once."""
    if error == "TIMEOUT":
        return (
            f"a rank of the {world} waited {ddp_timeout_s} s (--ddp_timeout) for another in a collective "
            "operation and gave up, as that process hangs (stopped, deadlocked, stuck in I/O) or lost its "
            "network, and the launcher stops every process: resume with --resume_from_checkpoint latest, and "
            "raise --ddp_timeout only if one rank legitimately works alone that long."
        )
    return (
        f"a rank of the {world} lost its connection to another (NCCL: {error}), as that process died or its "
        "network failed, and the launcher stops every process: resume with --resume_from_checkpoint latest."
    )


class PeerWatch:
    """See the module docstring. `start()` once the process group exists, `stop()` after the run's
    last collective."""

    def __init__(self, rank: int, world: int, ddp_timeout_s: int, backend_error=None):
        self.rank, self.world, self.ddp_timeout_s = rank, world, ddp_timeout_s
        self.backend_error = backend_error  # NCCL: the process group's error by name (None elsewhere)
        self.machine = machine()
        self.peers: dict[int, tuple[str, int, str]] = {}  # rank -> (machine, pid, start), once registered
        self.store = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="amp_recipes.PeerWatch", daemon=True)

    @classmethod
    def for_run(cls, accelerator, ddp_timeout_s: int) -> PeerWatch | None:
        """The watch of a multi-process run (None for one process)."""
        if accelerator.num_processes < 2:
            return None
        return cls(
            accelerator.process_index, accelerator.num_processes, ddp_timeout_s, nccl_error(accelerator)
        )

    def connect(self) -> None:
        """Register this process (machine, pid, start time) in the launch's store, for the others."""
        self.store = errors.agent_store()
        if self.store is not None and self.machine is not None:
            pid = os.getpid()
            try:
                self.store.set(
                    errors.store_key(f"pid/{self.rank}"), f"{self.machine} {pid} {process_start(pid)}"
                )
            except Exception:  # noqa: BLE001 - no store: the watch looks at NCCL's error alone
                self.store = None

    def start(self) -> PeerWatch:
        self.connect()
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    # ------------------------------------------------------------------ what it looks at
    def _peer(self, rank: int) -> tuple[str, int, str] | None:
        """Where rank `rank` runs, its pid and start time, once it has registered."""
        if rank not in self.peers:
            key = errors.store_key(f"pid/{rank}")
            if not self.store.check([key]):
                return None
            where, pid, start = self.store.get(key).decode().split(" ")
            self.peers[rank] = (where, int(pid), start)
        return self.peers[rank]

    def _ended(self, rank: int) -> str | None:
        key = errors.store_key(f"ended/{rank}")
        return self.store.get(key).decode() if self.store.check([key]) else None

    def check(self) -> str | None:
        """The sentence to end this process with, or None while nothing is wrong."""
        if errors.ending_on_purpose():  # this process is ending by its own path: nothing to add
            return None
        if self.store is not None:
            lost_key = errors.store_key("lost")
            if self.store.check([lost_key]):  # written by the ranks that saw it go
                return self.store.get(lost_key).decode()
            for rank in range(self.world):
                peer = None if rank == self.rank or self.machine is None else self._peer(rank)
                if peer is None or peer[0] != self.machine or process_start(peer[1]) == peer[2]:
                    continue  # not registered yet, on another machine, or running
                ended = self._ended(rank)
                if ended in ENDED_ON_PURPOSE:  # it finished, was preempted with the rest, or gave up too
                    continue
                if ended == "error":
                    return failed_message(self.world)
                host = peer[0].split("/")[0]
                message = died_message(rank, self.world, f"pid {peer[1]} on {host}")
                self.store.compare_set(lost_key, "", message)  # the first to see it names it for all
                return self.store.get(lost_key).decode()
            if self.store.check([errors.store_key("failed")]):
                return failed_message(self.world)
        error = self.backend_error() if self.backend_error else None
        if error in (None, "SUCCESS"):
            return None
        message = nccl_message(error, self.world, self.ddp_timeout_s)
        if self.store is None:
            return message
        # Ranks may see different errors (one a timeout, another the broken connection): the first
        # to write its sentence names it for all, so that the launch prints one.
        self.store.compare_set(errors.store_key("lost"), "", message)
        return self.store.get(errors.store_key("lost")).decode()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self.stopped.wait(POLL_S):
            try:
                message = self.check()
            except Exception:  # noqa: BLE001 - a store that stopped answering: the launch is ending
                message = None
            if message is None:
                continue
            # The main thread ended the run, or its last collective, meanwhile; or is ending by its
            # own path (its own error or a lost rank, said in its own sentence).
            if self.stopped.wait(GRACE_S) or errors.ending_on_purpose():
                return
            self.end(message)

    def end(self, message: str) -> None:
        """Say why (once for the launch), release the output folder, say this rank gave up (the
        others must not take its end for a death), end the process."""
        sentence = f"error: {message}"
        if errors.first_to_say(sentence):
            os.write(2, f"{sentence}\n".encode())  # not print(): the main thread may hold stderr's lock
        outputs.release_held()
        errors.mark_end("gave_up")
        os._exit(1)


def nccl_error(accelerator):
    """A function returning the NCCL process group's error by name ("SUCCESS", "TIMEOUT",
    "COMM_ERROR", "REMOTE_ERROR"; ProcessGroupNCCL.get_error, torch 2.11), or None where the
    backend is not NCCL."""
    import torch
    import torch.distributed as dist

    if accelerator.device.type != "cuda" or not dist.is_initialized() or "nccl" not in dist.get_backend():
        return None
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    if not hasattr(backend, "get_error"):
        return None
    return lambda: backend.get_error().name
