"""The passes of a communicator: per direction ('forward', 'backward') the all-reduce's
compensator state streams and site counter, and the same per kind for the reduce-scatter and
the all-gather; `new_pass` resets a direction (telemetry too), `pass_scope` runs one pass, and
`state` reads a stream. EchoCommunicator is one."""
from __future__ import annotations

import contextlib

from .checks import check_direction
from .compensator import PassState
from .config import DIRECTIONS, KINDS
from .telemetry import Telemetry


class Passes:
    """Compensator state streams and site counters of every kind and direction."""

    def __init__(self, telemetry: Telemetry | None = None):
        self.passes = {d: PassState() for d in DIRECTIONS}
        """The all-reduce's compensator state streams and site counters, per direction."""
        self.half_passes = {k: {d: PassState() for d in DIRECTIONS} for k in KINDS[1:]}
        """The same for the reduce-scatter and all-gather: [kind][direction]."""
        self.telemetry = telemetry
        self._open_scopes: set[str] = set()

    def new_pass(self, direction: str = "forward") -> None:
        """Start a pass: zero the compensator state of `direction` and restart site numbering."""
        check_direction(direction)
        self.passes[direction].reset()
        for kind in self.half_passes.values():
            kind[direction].reset()
        if self.telemetry is not None:
            self.telemetry.new_pass(direction)

    @contextlib.contextmanager
    def pass_scope(self, direction: str = "forward"):
        """`with comm.pass_scope('forward'):` runs one pass with fresh compensator state.
        Scopes of one direction do not nest (the inner one would reset the outer pass)."""
        check_direction(direction)
        if direction in self._open_scopes:
            raise RuntimeError(f"a {direction!r} pass_scope is already open on this "
                               "communicator; a nested one would reset the outer pass's "
                               "compensator state. Close the outer scope first, or use a second "
                               "communicator for an independent pass")
        self.new_pass(direction)
        self._open_scopes.add(direction)
        try:
            yield self
        finally:
            self._open_scopes.discard(direction)

    def state(self, direction: str = "forward", numel: int | None = None,
              kind: str = "all_reduce"):
        """The compensator state (CompState) of a direction's stream of `numel`-sized calls of
        `kind` (numel: the input's per-rank size)."""
        streams = self._pass(kind, direction).streams
        if numel is None:
            if len(streams) != 1:
                raise ValueError(f"{len(streams)} state streams exist; name numel")
            return next(iter(streams.values()))
        return streams.get(numel)

    def _pass(self, kind: str, direction: str) -> PassState:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return self.passes[direction] if kind == "all_reduce" else \
            self.half_passes[kind][direction]

    def reset_passes(self) -> None:
        """Drop every state stream of every kind and direction."""
        for ps in self.passes.values():
            ps.reset()
        for kind in self.half_passes.values():
            for ps in kind.values():
                ps.reset()
