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

import contextlib
import threading


class OneThread:
    """The one-thread rule of one communicator (the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.broken: str | None = None
        """Why every call is refused (None: none is)."""

    @contextlib.contextmanager
    def entered(self, name: str):
        """The body runs as the one thread inside; RuntimeError for a second one, and for every
        call after that."""
        if not self._lock.acquire(blocking=False):
            self.broken = (f"{name} was entered from two threads at once on one "
                           "communicator; the calls' results are undefined (their packets may "
                           "have met the peers' in either order), so this communicator refuses "
                           "every call now. Use one communicator per thread, or serialize the "
                           "calls")
            raise RuntimeError(self.broken)
        try:
            self.refuse_if_broken()
            yield
            self.refuse_if_broken()
        finally:
            self._lock.release()

    def refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)
