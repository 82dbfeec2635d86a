"""Stopping on SIGTERM / SIGINT: :class:`Interrupted` and its exit status, which the trainer, the command line and
``dres-launch`` share, and :func:`on_signal`, which turns the signals into a stop from the command line's first
line to its last (this module imports nothing of the trainer).

What a signal does depends on what the process is doing, so whoever runs routes it (:func:`on_signal`): before a
trainer exists it raises :class:`Interrupted` at once (:func:`stop_at_once`, nothing to save); the trainer finishes
its step and saves, or stops at once where no step is under way; once the run has ended the process ends as it
would have (:func:`let_it_end`, and :func:`ignore_at_exit` while the interpreter exits)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable

# sysexits' EX_TEMPFAIL ("try again later"): the run stopped on a signal after saving, --resume auto continues it
EXIT_INTERRUPTED = 75

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(RuntimeError):
    """The run stopped on SIGTERM / SIGINT; the message says what was saved (exit status
    :data:`EXIT_INTERRUPTED`)."""


def stop_at_once(name: str, before: str = "training started") -> None:
    """Before the work (``before``: what had not begun): nothing to finish or save."""
    raise Interrupted(f"stopped by {name} before {before} (exit status {EXIT_INTERRUPTED})")


def let_it_end(name: str) -> None:
    """After the run, or the error that ended it: what it wrote stays, and the process ends with its own status."""


class StopOnSignal:
    """While installed, SIGTERM and SIGINT (what schedulers send before they kill, and Ctrl-C) call ``route(name)``
    (the signal's name), which raises :class:`Interrupted` to stop at once or returns to let the run stop at a
    point of its own. After the first signal both signals take their default action again, so a second one ends
    the process at once (the checkpoint being written, if any, stays a temporary the next resume ignores). Only
    the main thread can take signals; elsewhere this does nothing."""

    def __init__(self, route: Callable[[str], None]):
        self.route = route
        self.previous: dict = {}
        self.pid = os.getpid()
        self.deferred = None  # the thread that delivers a signal once an import ends (_deliver_after_import)
        self.raised: Interrupted | None = None  # the stop route raised (raised_stop)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.getsignal(s) for s in SIGNALS}
            for s in SIGNALS:
                signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if os.getpid() != self.pid:  # a forked data-loader worker: it reacts as it would without this handler
            previous = self.previous.get(signum, signal.SIG_DFL)
            if callable(previous):
                return previous(signum, frame)
            if previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        if _importing(frame):  # an exception raised inside an import can come out as another, or be swallowed
            self._deliver_after_import(signum)
            return
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        try:
            self.route(signal.Signals(signum).name)
        except Interrupted as e:
            self.raised = e
            raise

    def _deliver_after_import(self, signum):
        """Send ``signum`` to the main thread again once no import is under way there (the signals that arrive
        meanwhile are this one)."""
        if self.deferred is not None:
            return
        main = threading.main_thread().ident

        def deliver():
            while _importing(sys._current_frames().get(main)):
                time.sleep(0.01)
            self.deferred = None
            signal.pthread_kill(main, signum)

        self.deferred = threading.Thread(target=deliver, name="dres-stop-after-import", daemon=True)
        self.deferred.start()

    def take_deferred(self):
        """Take a signal deferred during an import now (called outside any import): it reaches this handler, not
        the one that takes the signals over next."""
        delivery = self.deferred
        if delivery is not None:
            delivery.join()  # the signal interrupts the wait, and the handler runs

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        return False


def _importing(frame) -> bool:
    """Whether ``frame`` or one of its callers is Python's import machinery."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


_installed: list[StopOnSignal] = []  # the handler of this process, while one is installed


@contextlib.contextmanager
def on_signal(route: Callable[[str], None]):
    """Within the block the signals go to ``route``: through the handler already installed (the command line
    installs one at its start, routed to :func:`stop_at_once`), which takes :func:`let_it_end` after the block,
    or through one installed for the block."""
    if _installed:
        handler = _installed[-1]
        handler.route = route
        try:
            yield handler
        finally:
            handler.route = let_it_end
        return
    with StopOnSignal(route) as handler:
        _installed.append(handler)
        try:
            yield handler
        finally:
            _installed.remove(handler)


def raised_stop() -> Interrupted | None:
    """The stop the installed handler raised, if it did: code that catches every exception (a reader that turns
    each failure into an error of its own) can hand it on inside another."""
    return _installed[-1].raised if _installed else None


def raise_if_stopped(error: Exception) -> None:
    """Raise the stop that ``error`` is or hands on (:func:`raised_stop`), if any: for code that turns every
    failure into an error of its own, so that a signal is not mistaken for one."""
    if isinstance(error, Interrupted):
        raise error
    stopped = raised_stop()
    if stopped is not None:
        raise stopped from error


def hand_over() -> None:
    """Before other code takes SIGTERM / SIGINT over with handlers of its own (torchrun): a signal that arrived during
    an import, deferred to its end, is taken now by the handler installed."""
    for handler in _installed:
        handler.take_deferred()


def run_command(body: Callable[[], int], stopped: Callable[[Interrupted], int], before: str) -> int:
    """A command line's ``body`` with SIGTERM / SIGINT a stop from its first line to the process's end: until
    ``body`` routes them elsewhere (:func:`on_signal`) a signal stops it at once (:func:`stop_at_once`, ``before``
    saying what had not begun), which ``stopped`` reports (its one line, its exit status); once the interpreter
    exits they are ignored. Returns the command's exit status."""
    ignore_at_exit()
    with on_signal(lambda name: stop_at_once(name, before)):
        try:
            return body()
        except Interrupted as e:
            return stopped(e)


def _ignore_signals() -> None:
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def ignore_at_exit() -> None:
    """SIGTERM and SIGINT ignored from the interpreter's exit on (its modules' teardown takes about a second after
    the command returned): the run has ended, and the process ends with the status it returned."""
    atexit.unregister(_ignore_signals)
    atexit.register(_ignore_signals)
