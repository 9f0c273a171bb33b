"""One communicator serves one thread: the guard around every collective call.

    guard = OneThread()
    with guard.entered("all_reduce"):
        y = ...                    # the call

A second thread entering while another is inside raises RuntimeError, and the guard then
refuses every later call (the two calls' packets may have met their peers' in either order,
so no later result could be trusted); build one communicator per thread. The refusal is
checked on entry and again before the call's result is handed back.
"""
from __future__ import annotations

import threading


class OneThread:
    """The one-thread rule of one communicator (the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.broken: str | None = None
        """Why every call is refused (None: none is)."""

    def entered(self, name: str) -> "_Entered":
        """`with guard.entered(name):` the body runs as the one thread inside; RuntimeError for
        a second one, and for every call after that."""
        return _Entered(self, name)

    def refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)


class _Entered:
    """One call inside the guard (a class, not a generator: this runs on every collective)."""

    __slots__ = ("guard", "name")

    def __init__(self, guard: OneThread, name: str):
        self.guard, self.name = guard, name

    def __enter__(self) -> None:
        g = self.guard
        if not g._lock.acquire(blocking=False):
            g.broken = (f"{self.name} was entered from two threads at once on one "
                        "communicator; the calls' results are undefined (their packets may "
                        "have met the peers' in either order), so this communicator refuses "
                        "every call now. Use one communicator per thread, or serialize the "
                        "calls")
            raise RuntimeError(g.broken)
        try:
            g.refuse_if_broken()
        except BaseException:
            g._lock.release()
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.guard.refuse_if_broken()
        finally:
            self.guard._lock.release()
