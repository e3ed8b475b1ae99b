"""The one error policy every Redis round trip goes through: the circuit breaker, redis-py's
errors translated into kvstore's typed ones, and the breaker told whether the server answered."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kvstore.errors import (
    StoreCircuitOpenError,
    StoreClosedError,
    StoreTimeoutError,
    StoreUnavailableError,
)
from kvstore.net.breaker import CircuitBreaker
from kvstore.net.connection import AclScope, translated_errors

T = TypeVar("T")


class Guard:
    def __init__(
        self,
        probe: Callable[[], object],
        *,
        safe_url: str,
        failures: int = 3,
        probe_s: float = 0.5,
        on_unavailable: Callable[[], None] = lambda: None,
        scope: AclScope | None = None,
    ) -> None:
        self.safe_url = safe_url
        # set by ``LookupBuffer.close``: no round trip after it (redis-py would quietly open
        # new connections, and the fan-out threads were gone: a RuntimeError)
        self.closed = False
        # whose keys a permission error's hint grants: the namespace this guard's calls serve
        self.scope = scope
        self._on_unavailable = on_unavailable
        self.breaker = CircuitBreaker(
            probe, name=f"Redis at {safe_url}", failure_threshold=failures, probe_interval_s=probe_s
        )

    def call(self, command: str, fn: Callable[[], T]) -> T:
        """Run one round trip: fail fast while the breaker is open, translate errors to
        kvstore's types (``command`` names what ran, for permission errors), and count
        unavailability (refused, reset, timed out, a Cluster down or resharding, a server
        loading its data) towards opening the breaker; each such failure but a timeout also
        calls ``on_unavailable`` (a Cluster relearns its slot map there)."""
        if not self.breaker.allow():
            raise StoreCircuitOpenError(
                f"{self.safe_url} is skipped for now: recent calls failed "
                f"({self.breaker.last_error}); it is used again once it answers a probe "
                f"(every {self.breaker.probe_interval_s:g}s; LookupBuffer.probe() asks now)"
            )
        result = self.call_anyway(command, fn)
        self.breaker.record_success()
        return result

    def call_anyway(self, command: str, fn: Callable[[], T]) -> T:
        """As :meth:`call`, but sent even while the breaker is open, and a success is not
        recorded (it must not close a breaker the regular calls opened): for the rare calls
        that put things right (giving claimed values back), which must not be skipped because
        the failure they repair opened the breaker."""
        if self.closed:
            raise StoreClosedError(
                f"the store of {self.safe_url} was closed (LookupBuffer.close): nothing more is "
                f"sent through it ({command}); open a new one"
            )
        try:
            with translated_errors(self.safe_url, command, self.scope):
                result = fn()
        except (StoreUnavailableError, StoreTimeoutError) as exc:
            self.breaker.record_failure(str(exc))
            if isinstance(exc, StoreUnavailableError):  # not a timeout: relearning would
                self._on_unavailable()  # ask the hung server too
            raise
        return result

    def stop(self, wait_s: float) -> None:
        """Stop the breaker's probing, waiting up to ``wait_s`` for a probe under way."""
        self.breaker.stop(wait_s)
