"""Background interconnect load: peer-to-peer copies on their own stream at a set duty cycle.

Each rank copies a buffer to the next rank's GPU (ring) on a dedicated low-priority stream, in
periods of `period_ms`: one copy taking ~duty * period, then a GPU-side sleep for the rest, so
the link is busy `duty` of the time whatever the foreground does. A host thread keeps a bounded
number of periods queued ahead (no host sync in the foreground). The same load is used for NCCL
and for Echo, as in the paper's Table 3.

    with BackgroundLoad(duty=0.5, rank=r, world_size=P):
        ... timed foreground work ...
"""
from __future__ import annotations

import threading
import time

import torch


class BackgroundLoad:
    def __init__(self, *, duty: float, rank: int, world_size: int, period_ms: float = 2.0,
                 max_bytes: int = 256 << 20, queue_ahead: int = 8):
        if not 0.0 <= duty <= 1.0:
            raise ValueError(f"duty must lie in [0, 1], got {duty}")
        if not torch.cuda.is_available():
            raise RuntimeError("BackgroundLoad needs CUDA GPUs")
        self.duty, self.rank, self.world = duty, rank, world_size
        self.period_ms = period_ms
        self.queue_ahead = queue_ahead
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.peer = torch.device("cuda", (self.device.index + 1) % torch.cuda.device_count())
        self.stream = torch.cuda.Stream(device=self.device, priority=0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.nbytes = 0
        self.sleep_cycles = 0
        if duty > 0 and world_size > 1:
            self._calibrate(max_bytes)

    def _calibrate(self, max_bytes: int) -> None:
        """Pick a copy size that takes duty*period and the sleep (in GPU cycles) for the rest."""
        src = torch.empty(max_bytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty(max_bytes, dtype=torch.uint8, device=self.peer)
        with torch.cuda.stream(self.stream):
            for _ in range(3):
                dst.copy_(src, non_blocking=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            for _ in range(5):
                dst.copy_(src, non_blocking=True)
            end.record(self.stream)
        end.synchronize()
        bytes_per_ms = 5 * max_bytes / start.elapsed_time(end)
        self.nbytes = max(1 << 20, min(max_bytes, int(self.duty * self.period_ms * bytes_per_ms)))
        self.src, self.dst = src[:self.nbytes], dst[:self.nbytes]
        # GPU clock rate for torch.cuda._sleep: measure cycles per ms once
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            torch.cuda._sleep(1_000_000)
            end.record(self.stream)
        end.synchronize()
        cycles_per_ms = 1_000_000 / start.elapsed_time(end)
        idle_ms = (1 - self.duty) * self.period_ms
        self.sleep_cycles = int(idle_ms * cycles_per_ms)
        self.bytes_per_ms = bytes_per_ms

    def _loop(self) -> None:
        done = []
        while not self._stop.is_set():
            with torch.cuda.stream(self.stream):
                self.dst.copy_(self.src, non_blocking=True)
                if self.sleep_cycles:
                    torch.cuda._sleep(self.sleep_cycles)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            done.append(ev)
            if len(done) > self.queue_ahead:
                done.pop(0).synchronize()  # bound the queue; blocks this thread only
        for ev in done:
            ev.synchronize()

    def __enter__(self) -> "BackgroundLoad":
        if self.nbytes:
            torch.cuda.set_device(self.device)
            self._stop.clear()
            self._thread = threading.Thread(target=self._thread_main, daemon=True)
            self._thread.start()
            time.sleep(0.05)
        return self

    def _thread_main(self) -> None:
        torch.cuda.set_device(self.device)
        self._loop()

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
