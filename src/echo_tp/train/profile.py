"""`train --profile-steps N`: the run's last N steps under torch.profiler, summed per kernel name
into out_dir/profile.json (loop.py calls it; studies read the file).

    window = ProfileWindow(n, steps, device)
    for step in range(steps):
        window.before(step)          # step steps - n: a device sync, then the profiler starts
        ... the step ...
        if last: window.stop()       # a device sync, then the profiler stops
    window.write(out_dir / "profile.json")

What is counted: on CUDA every device activity of the window (kernels, memcpy, memset) by name,
kernels a CUDA graph replays included, each its duration on the device (record_function ranges
on the GPU timeline left out: they span kernels already counted); on the CPU every operator by
name (record_function ranges and Python functions left out), each its self time, so nested
operators are not counted twice. The window's wall seconds lie between its two device
syncs. With --cuda-graph, let the window begin after the capture (steps - n > WARM_STEPS of
graphed.py) so that it sees replays only.

profile.json: {"steps": n, "device": "cuda" | "cpu", "wall_s": seconds of the window,
"time_us": the rows' total, "rows": [{"name", "calls", "us"}, ...]}, rows by time, longest
first (totals over the window: divide by steps for one step).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

NAME_CHARS = 400
"""Kernel names longer than this are cut (C++ template names run to thousands)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarize(events, device_type: str) -> list[dict]:
    """Profiler events -> [{"name", "calls", "us"}], longest total first (module docstring:
    device activities on CUDA, operators' self time on the CPU)."""
    rows: dict[str, list] = {}
    for e in events:
        if device_type == "cuda":
            if e.device_type != DeviceType.CUDA or e.is_user_annotation:   # ranges: no kernels
                continue
            us = e.time_range.elapsed_us()
        else:
            if (e.device_type != DeviceType.CPU or e.is_async or e.is_user_annotation
                    or e.is_python_function):
                continue
            us = e.self_cpu_time_total
        row = rows.setdefault(e.name[:NAME_CHARS], [0, 0.0])
        row[0] += 1
        row[1] += us
    return [{"name": n, "calls": c, "us": round(us, 3)}
            for n, (c, us) in sorted(rows.items(), key=lambda kv: -kv[1][1])]


class ProfileWindow:
    """The last `steps` of a run of `total` steps under torch.profiler (module docstring)."""

    def __init__(self, steps: int, total: int, device: torch.device):
        if not 1 <= steps <= total:
            raise ValueError(f"profile steps must be in 1..{total} (the run's steps), got {steps}")
        self.first = total - steps
        """The index of the window's first step."""
        self.device = device
        self.steps = 0
        """Steps begun inside the window."""
        self.result: dict | None = None
        self._prof = None
        self._t0 = 0.0

    def before(self, step: int) -> None:
        """Call before step `step` (0-based) runs."""
        if step == self.first:
            _sync(self.device)
            activity = ProfilerActivity.CUDA if self.device.type == "cuda" else \
                ProfilerActivity.CPU
            self._prof = profile(activities=[activity])
            self._prof.start()
            self._t0 = time.perf_counter()
        if self._prof is not None and self.result is None:
            self.steps += 1

    def stop(self) -> None:
        """End the window after the step that ran last (a no-op before it began or once
        stopped)."""
        if self._prof is None or self.result is not None:
            return
        _sync(self.device)
        wall = time.perf_counter() - self._t0
        self._prof.stop()
        rows = summarize(self._prof.events(), self.device.type)
        self.result = {"steps": self.steps, "device": self.device.type, "wall_s": wall,
                       "time_us": round(sum(r["us"] for r in rows), 3), "rows": rows}
        self._prof = None

    def write(self, path: Path) -> Path | None:
        """profile.json at path (None, nothing written: the run ended before the window)."""
        self.stop()
        if self.result is None:
            return None
        path.write_text(json.dumps(self.result, indent=1) + "\n")
        return path
