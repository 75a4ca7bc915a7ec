"""amp_recipes.training.peers.PeerWatch's decisions, against a real TCPStore standing in for the one
torchrun's agent keeps, real processes that have ended, and NCCL's own error names
(torch's ErrorType). The whole path, a launch whose rank dies while another waits in a collective
that never completes, runs in tests/recipes/test_scale_out.py."""

import os
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from conftest import free_port
from torch._C._distributed_c10d import ErrorType

from amp_recipes import errors
from amp_recipes.training import peers


@pytest.fixture
def store(monkeypatch):
    """A store as torchrun's agent holds one for a launch of 3 ranks; this test is rank 0."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5))
    for name, value in {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "3",
        "RANK": "0",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setitem(errors._END, "kind", None)
    # The product gives a launch's store 5 s to answer, and does without it after that. Beside CI's
    # other lanes, at nice 10, a connect to this in-process server has outlasted 5 s three times in
    # a row (CI's run of 4b40d48), which left the watch without a store: these tests give it 60 s.
    agent_store = errors.agent_store
    monkeypatch.setattr(errors, "agent_store", lambda: agent_store(timeout_s=60))
    yield server


def ended_process() -> int:
    """The pid of a process that has run and been collected by its parent."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def watch(**kwargs) -> peers.PeerWatch:
    """Rank 0's watch, connected to the test's store when it has one."""
    peer_watch = peers.PeerWatch(rank=0, world=3, ddp_timeout_s=600, **kwargs)
    peer_watch.connect()
    if "MASTER_PORT" in os.environ:  # the store fixture's: a watch without it would judge nothing
        assert peer_watch.store is not None, "the watch did not reach the test's store"
    return peer_watch


def put(store, name: str, value: str) -> None:
    """What another rank writes into the launch's store, applied before the watch reads it: under
    load the watch's own connection read a key before the writer's `set` was in (twice in CI's runs
    of 2026-12-08); a `get` on the writer's connection returns only once the server has the key."""
    store.set(errors.store_key(name), value)
    store.get(errors.store_key(name))


def register(store, rank: int, pid: int, machine: str | None = None, start: str | None = None) -> None:
    """As a rank registers itself: machine, pid, and the process's start time (an ended process's
    is gone: a start time it once had stands in)."""
    start = start or peers.process_start(pid) or "12345"
    put(store, f"pid/{rank}", f"{machine or peers.machine()} {pid} {start}")


def test_nothing_is_wrong_while_every_peer_runs(store):
    peer_watch = watch()
    register(store, 1, os.getppid())  # alive; rank 2 has not registered yet
    assert peer_watch.check() is None
    registered = store.get(errors.store_key("pid/0")).decode()
    assert registered == f"{peers.machine()} {os.getpid()} {peers.process_start(os.getpid())}"


def test_a_pid_taken_by_another_process_is_a_dead_peer(store):
    """The peer's pid now belongs to a process that started at another time: the peer is gone."""
    peer_watch = watch()
    register(store, 1, os.getppid(), start="1")
    assert peer_watch.check().startswith(f"rank 1 of 3 (pid {os.getppid()} on ")


def test_a_peer_gone_without_a_word_died_and_is_named_for_every_rank(store):
    peer_watch = watch()
    pid = ended_process()
    register(store, 1, os.getppid())
    register(store, 2, pid)
    expected = peers.died_message(2, 3, f"pid {pid} on {peers.machine().split('/')[0]}")
    assert peer_watch.check() == expected
    assert (
        expected.startswith(f"rank 2 of 3 (pid {pid} on ")
        and "resume with --resume_from_checkpoint latest" in expected
    )
    assert store.get(errors.store_key("lost")).decode() == expected  # what the other machines read


@pytest.mark.parametrize(
    "ended, expected",
    [("finished", None), ("stopped", None), ("gave_up", None), ("lost", None), ("error", "failed")],
)
def test_a_peer_that_said_how_it_ended_did_not_die(store, ended, expected):
    """A rank that finished (the others are saving), was preempted (all stop), gave up on a peer or
    lost one (its watch or its own error said why) or failed with its own error said so before its
    process ended: only the error ends the others, with a pointer to it."""
    peer_watch = watch()
    register(store, 1, ended_process())
    put(store, "ended/1", ended)
    message = peer_watch.check()
    assert message == (peers.failed_message(3) if expected == "failed" else None)
    assert not store.check([errors.store_key("lost")])


def test_a_peer_on_another_machine_is_judged_by_the_store_alone(store):
    """Its pid means nothing here; what its machine's ranks saw reaches this one through the store."""
    peer_watch = watch()
    register(store, 1, ended_process(), machine="elsewhere/1")
    assert peer_watch.check() is None
    lost = peers.died_message(1, 3, "pid 7 on elsewhere")
    put(store, "lost", lost)
    assert peer_watch.check() == lost


def test_a_rank_that_failed_elsewhere_ends_the_ones_waiting(store):
    peer_watch = watch()
    store.add(errors.store_key("failed"), 1)
    assert peer_watch.check() == peers.failed_message(3)


def test_nothing_to_add_once_this_rank_ends_by_its_own_path(store):
    peer_watch = watch()
    register(store, 1, ended_process())
    errors.mark_end("error")  # this rank failed: its own sentence says why
    assert peer_watch.check() is None
    assert store.get(errors.store_key("ended/0")).decode() == "error"


@pytest.mark.parametrize("error", list(ErrorType.__members__))
def test_nccls_own_error_ends_the_run_with_a_sentence(error, monkeypatch):
    """Under NCCL the process group's error (ProcessGroupNCCL.get_error) says that its watchdog timed
    a collective out, which it would answer by killing the process from C++ about 60 s later, or
    that a connection failed; no store here (a launch without torchrun's)."""
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setitem(errors._END, "kind", None)
    message = watch(backend_error=lambda: getattr(ErrorType, error).name).check()
    if error == "SUCCESS":
        assert message is None
    elif error == "TIMEOUT":
        assert message.startswith("a rank of the 3 waited 600 s (--ddp_timeout) for another in a collective")
    else:
        assert message.startswith(f"a rank of the 3 lost its connection to another (NCCL: {error})")
    # the same sentence on every rank, so that errors.first_to_say prints it once for the launch
    other_rank = peers.PeerWatch(rank=2, world=3, ddp_timeout_s=600, backend_error=lambda: error)
    assert other_rank.check() == message


def test_ranks_that_see_different_nccl_errors_print_one_sentence(store):
    """One rank's watchdog timed out, another saw the broken connection: the first sentence written
    to the launch's store is every rank's."""
    timed_out = watch(backend_error=lambda: "TIMEOUT")
    first = timed_out.check()
    assert first.startswith("a rank of the 3 waited 600 s (--ddp_timeout)")
    other = peers.PeerWatch(rank=1, world=3, ddp_timeout_s=600, backend_error=lambda: "REMOTE_ERROR")
    other.connect()
    assert other.check() == first


def test_a_zombie_counts_as_gone():
    """A rank that exited and its launcher has not collected yet has no start time any more."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    assert peers.process_start(child.pid) is not None  # running
    deadline = time.monotonic() + 10
    while peers.process_start(child.pid) is not None:
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.05)
    assert child.poll() == 0  # it was a zombie until now
    assert peers.process_start(child.pid) is None
    assert peers.process_start(os.getpid()) is not None


def test_this_machine_is_named_by_host_boot_and_pid_namespace():
    host, boot, namespace = peers.machine().split("/")
    assert host and len(boot) == 36 and namespace.isdigit()
