"""The model lock itself (:class:`shared_core.runtime.model_lock.FairLock`): arrival order,
reentrancy, an interrupt at any point of taking it, and a take of it run inside the same
thread's acquire (a finalizer, a signal handler) all leave it usable.

A trace function acts at one point of the lock's own Python code per run, every point in
turn: it raises ``KeyboardInterrupt`` wherever CPython checks for a pending signal (a frame's
first bytecode, after a call, at a backward jump), and takes the lock again at every bytecode
(a garbage collection can run at any allocation). One more test interrupts the C acquire with
a real ``SIGALRM``. No timing is measured: the deadlines only turn a deadlock into a failure.
"""

from __future__ import annotations

import dis
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import CodeType, FrameType
from typing import Any

import pytest
from interrupts import alarm_interrupt

from shared_core.runtime.model_lock import FairLock

DEADLINE_S = 20
LOCK_CODE = {f.__code__ for f in (FairLock.__enter__, FairLock.acquire, FairLock._take,
                                  FairLock._wait_turn)}


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < end, what
        time.sleep(0.001)


def _usable_by_another_thread(lock: FairLock) -> bool:
    got = threading.Event()
    other = threading.Thread(target=lambda: (lock.acquire(), got.set(), lock.release()),
                             daemon=True)
    other.start()
    other.join(DEADLINE_S)
    return got.is_set()


def _held_elsewhere(lock: FairLock) -> tuple[threading.Thread, threading.Event]:
    """A thread that holds ``lock`` (returned once it does) until the event is set."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            holding.set()
            release.wait(DEADLINE_S)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    holding.wait(DEADLINE_S)
    return holder, release


def _queued_elsewhere(lock: FairLock) -> threading.Thread:
    """A thread queued for ``lock`` (returned once it is) that releases it once it gets it."""
    waiter = threading.Thread(target=lambda: (lock.acquire(), lock.release()), daemon=True)
    waiter.start()
    _wait_for(lambda: lock.waiters() == 1, "the second thread never queued")
    return waiter


def _after_a_call_or_back_jump(code: CodeType, previous: int, current: int) -> bool:
    """Whether CPython checks for a pending signal between the bytecodes at offsets
    ``previous`` and ``current``: after a call has returned, on a backward jump."""
    if current < previous:
        return True
    called = dis.opname[code.co_code[previous]] in ("CALL", "PRECALL", "CALL_FUNCTION_EX")
    return called and dis.opname[code.co_code[current]] != "CALL"  # PRECALL's call is done


def _queued(lock: FairLock, frame: FrameType) -> bool:
    """Whether the call interrupted in ``frame`` has its place in the lock's queue (read without
    the queue's lock, which the interrupted call may hold)."""
    place = frame.f_locals.get("place")
    return place is not None and any(p is place for p in list(lock._queue))


@contextmanager
def act_at(n: int, action: Callable[[FrameType], Any], *, every_bytecode: bool = False
           ) -> Iterator[list[Any]]:
    """Call ``action(frame)`` at the ``n``-th point of the lock's code this thread runs where a
    signal handler can run (a frame's first bytecode, after each call, at each backward jump)
    or, with ``every_bytecode``, where a garbage collection can (any bytecode: any may
    allocate), with tracing off. Yields a list that gets ``action``'s result once it ran."""
    seen: list[int] = [0]
    done: list[Any] = []

    def local(last: list[int]) -> Callable[[FrameType, str, Any], Any]:
        def trace(frame: FrameType, event: str, arg: Any) -> Any:
            if event != "opcode" or done:
                return trace
            previous, last[0] = last[0], frame.f_lasti
            if (every_bytecode or previous < 0
                    or _after_a_call_or_back_jump(frame.f_code, previous, frame.f_lasti)):
                seen[0] += 1
                if seen[0] == n:
                    done.append(None)
                    done[0] = action(frame)
            return trace
        return trace

    def calls(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code in LOCK_CODE:
            frame.f_trace_opcodes = True
            return local([-1])
        return None

    sys.settrace(calls)
    try:
        yield done
    finally:
        sys.settrace(None)


@contextmanager
def interrupt_at(n: int, held: Callable[[FrameType], bool] = lambda frame: False
                 ) -> Iterator[list[bool]]:
    """Raise KeyboardInterrupt at the ``n``-th point where a signal can land in the lock's
    code (:func:`act_at`), as a SIGINT handled there would. Yields ``[raised, held]``: whether
    it was raised, and ``held(frame)`` at that moment (e.g. whether the call had taken it)."""
    raised = [False, False]

    def interrupt(frame: FrameType) -> None:
        raised[:] = [True, held(frame)]
        raise KeyboardInterrupt(f"at {frame.f_code.co_name}+{frame.f_lasti}")

    with act_at(n, interrupt):
        yield raised


def test_fair_lock_is_fifo_and_reentrant() -> None:
    lock = FairLock()
    order: list[int] = []
    lock.acquire()
    with lock:  # reentrant
        assert lock.locked()
    threads = []
    for i in range(8):
        t = threading.Thread(target=lambda i=i: (lock.acquire(), order.append(i), lock.release()),
                             daemon=True)
        t.start()
        _wait_for(lambda i=i: lock.waiters() == i + 1, "a thread never queued")  # in this order
        threads.append(t)
    lock.release()
    for t in threads:
        t.join(DEADLINE_S)
    assert order == list(range(8)) and not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()


@pytest.mark.parametrize("held", [0, 1], ids=["free", "reentrant"])
def test_an_interrupt_at_any_bytecode_of_an_uncontended_enter_leaves_the_lock_usable(held: int
                                                                                     ) -> None:
    lock = FairLock()
    for _ in range(held):
        lock.acquire()
    taken_when_interrupted = 0
    for n in range(1, 500):
        with interrupt_at(n, lambda frame: lock._held._recursion_count() > held) as raised:
            try:
                with lock:
                    assert lock._held._recursion_count() == held + 1
            except KeyboardInterrupt:
                assert raised[0]
                taken_when_interrupted += raised[1]
        assert lock._held._recursion_count() == held and lock.waiters() == 0, f"opcode {n}"
        if not raised[0]:
            break
    else:
        pytest.fail("the lock's code never ran to the end without an interrupt")
    assert taken_when_interrupted >= 2  # some landed after the grant: those give it back
    for _ in range(held):
        lock.release()
    assert not lock.locked() and _usable_by_another_thread(lock)


def test_an_interrupt_at_any_bytecode_of_a_queued_enter_leaves_the_queue_and_the_lock_usable(
) -> None:
    """This thread arrives third (one thread holds the lock, one is queued ahead of it) and is
    interrupted at each bytecode in turn; then the holder releases, the queued thread gets the
    lock and releases it, and the lock is free with nobody queued."""
    queued_when_interrupted = 0
    for n in range(1, 500):
        lock = FairLock()
        first, release = _held_elsewhere(lock)
        second = _queued_elsewhere(lock)
        # the holder lets go once this thread is queued behind the second, or gave up
        done = threading.Event()
        releaser = threading.Thread(
            target=lambda lock=lock, done=done, release=release: (
                _wait_for(lambda: lock.waiters() == 2 or done.is_set(), "no progress"),
                release.set()),
            daemon=True)
        releaser.start()
        with interrupt_at(n, lambda frame, lock=lock: _queued(lock, frame)) as raised:
            try:
                with lock:
                    pass
            except KeyboardInterrupt:
                assert raised[0]
                queued_when_interrupted += raised[1]
            finally:
                done.set()
        for t in (releaser, first, second):
            t.join(DEADLINE_S)
            assert not t.is_alive(), f"opcode {n}: a thread never got the lock"
        assert lock._held._recursion_count() == 0 and lock.waiters() == 0, f"opcode {n}"
        assert not lock.locked() and _usable_by_another_thread(lock), f"opcode {n}"
        if not raised[0]:
            break
    else:
        pytest.fail("the lock's code never ran to the end without an interrupt")
    assert queued_when_interrupted >= 3  # its place in the queue: it leaves it


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
def test_a_signal_while_blocked_in_the_c_acquire_leaves_the_queue() -> None:
    """The head of the queue waits in the C lock's acquire; Ctrl-C (here SIGALRM raising
    KeyboardInterrupt) interrupts that wait, and the caller leaves without the lock."""
    lock = FairLock()
    holder, release = _held_elsewhere(lock)
    with alarm_interrupt(0.2), pytest.raises(KeyboardInterrupt), lock:
        pytest.fail("the lock was granted while another thread held it")
    assert lock._held._recursion_count() == 0 and lock.waiters() == 0
    release.set()
    holder.join(DEADLINE_S)
    assert not lock.locked() and _usable_by_another_thread(lock)


def test_the_with_statements_release_runs_no_python_code() -> None:
    """The release a with-statement makes is the C lock's: no Python frame (where an interrupt
    could land and skip it) runs between the block's end and the lock being free."""
    lock = FairLock()
    frames: list[str] = []
    with lock:
        sys.settrace(lambda frame, event, arg: frames.append(frame.f_code.co_name))
    sys.settrace(None)
    assert frames == [] and not lock.locked()


def _nested_take(lock: FairLock) -> Callable[[FrameType], str]:
    """An action that takes the lock again on this thread, as a generator's finalizer run by a
    garbage collection (or a signal handler) in the middle of this thread's acquire would."""
    def take(frame: FrameType) -> str:
        with lock:
            assert lock._held._recursion_count() >= 1
        return f"{frame.f_code.co_name}+{frame.f_lasti}"
    return take


@pytest.mark.parametrize("queued_behind", [False, True], ids=["free", "queued"])
def test_the_lock_taken_again_at_any_bytecode_of_taking_it_on_the_same_thread(queued_behind: bool
                                                                              ) -> None:
    """A finalizer that takes the lock (a RAPID stream's, a ``step_locked`` stream's) can run at
    any allocation of any thread, so also in the middle of that thread's own acquire of the
    same lock: the inner take completes, then the outer one."""
    for n in range(1, 2000):
        lock = FairLock()
        others: list[threading.Thread] = []
        release = threading.Event()
        if queued_behind:
            holder, release = _held_elsewhere(lock)
            others = [holder, _queued_elsewhere(lock)]
        outcome: list[Any] = []

        def outer(lock: FairLock = lock, n: int = n, outcome: list[Any] = outcome) -> None:
            with act_at(n, _nested_take(lock), every_bytecode=True) as done, lock:
                outcome.append(lock._held._recursion_count())
            outcome.append(done)

        runner = threading.Thread(target=outer, daemon=True)
        runner.start()
        if queued_behind:
            _wait_for(lambda runner=runner, lock=lock: lock.waiters() == 2 or not runner.is_alive(),
                      "the call never queued")
            release.set()
        runner.join(DEADLINE_S)
        assert not runner.is_alive(), f"bytecode {n}: deadlock"
        for t in others:
            t.join(DEADLINE_S)
        assert outcome[0] == 1, f"bytecode {n}"
        assert not lock.locked() and lock.waiters() == 0, f"bytecode {n}"
        if not outcome[1]:
            return
    pytest.fail("the lock's code never ran to the end")
