"""A fixed pool of equal-size buffers: host memory (pinned when CUDA is present), or device
scratch memory.

Staging memory is allocated once and reused: steady-state traffic allocates none, and the pool's
size bounds the bytes in flight (a caller that finds it empty sheds work instead of growing).
"""

from __future__ import annotations

import threading

import torch


class StagingPool:
    def __init__(
        self,
        buffer_bytes: int,
        count: int,
        *,
        pin_memory: bool | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if buffer_bytes <= 0 or count <= 0:
            raise ValueError(
                f"buffer_bytes and count must be positive, got {buffer_bytes}, {count}"
            )
        device = torch.device(device)
        if device.type != "cpu":
            pin_memory = False  # device memory: nothing to pin
        elif pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.buffer_bytes = buffer_bytes
        self.count = count
        self.pinned = pin_memory
        self.device = device
        self._free = [
            torch.empty(buffer_bytes, dtype=torch.uint8, device=device, pin_memory=pin_memory)
            for _ in range(count)
        ]
        self._cond = threading.Condition()
        self._waiting = 0  # callers blocked in acquire()

    def try_acquire(self) -> torch.Tensor | None:
        with self._cond:
            return self._free.pop() if self._free else None

    @property
    def waiting(self) -> int:
        """Callers blocked in :meth:`acquire` now."""
        with self._cond:
            return self._waiting

    def try_acquire_spare(self) -> torch.Tensor | None:
        """A free buffer only if no caller is waiting for one: for work that is optional
        (reading ahead), so it never takes a buffer from work that is not."""
        with self._cond:
            return self._free.pop() if self._free and not self._waiting else None

    def acquire(self, timeout_s: float | None = None) -> torch.Tensor | None:
        with self._cond:
            self._waiting += 1
            try:
                if not self._cond.wait_for(lambda: bool(self._free), timeout=timeout_s):
                    return None
            finally:
                self._waiting -= 1
            return self._free.pop()

    def release(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._cond.notify()
