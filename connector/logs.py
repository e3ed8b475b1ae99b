"""The connector's logging: its lines (and kvstore's) in vLLM's log, with vLLM's format and
level, and sparse warnings -- a handful of lines per cause during an outage, not one per block.
"""

from __future__ import annotations

import logging
import threading

# kvstore knows nothing of vLLM; the connector hands its logger to vLLM's handlers too
OUR_LOGGERS = ("connector", "kvstore")


class _ToVllm(logging.Handler):
    """Hands records to vLLM's logger, so they meet its current handlers and format (vLLM may
    reconfigure logging after we attached)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def adopt_vllm_logging() -> None:
    """Route our loggers' records through vLLM's handlers, at vLLM's level
    (VLLM_LOGGING_LEVEL; VLLM_LOGGING_CONFIG_PATH applies too). Call it once vLLM has configured
    logging in this process (the connector does, when it is created). Without vLLM's logging
    (VLLM_CONFIGURE_LOGGING=0), with handlers on the root logger (the application's, or
    pytest's) or with a logger the user configured, records propagate as usual."""
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers or logging.getLogger().handlers:
        return  # vLLM does not log here, or the application configured the root logger
    for name in OUR_LOGGERS:
        logger = logging.getLogger(name)
        ours = any(isinstance(h, _ToVllm) for h in logger.handlers)
        if not ours and (logger.handlers or logger.level != logging.NOTSET):
            continue  # configured by the user
        if not ours:
            logger.addHandler(_ToVllm())
            logger.propagate = False  # vLLM's handler writes it, once
        logger.setLevel(vllm_logger.getEffectiveLevel())


class FailureCounts:
    """Totals of failures by cause, and which of them to log: a line when a cause's total
    reaches 1, 2, 4, 8, ... so an outage logs a handful of lines per cause instead of one per
    request or block."""

    def __init__(self) -> None:
        self._totals: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, kind: str, n: int = 1) -> int | None:
        """Count ``n`` more; returns the new total when it should be logged, else None."""
        with self._lock:
            old = self._totals.get(kind, 0)
            new = self._totals[kind] = old + n
        return new if new.bit_length() != old.bit_length() else None

    def __getitem__(self, kind: str) -> int:
        with self._lock:
            return self._totals.get(kind, 0)


def log_bug(
    failures: FailureCounts, log: logging.Logger, where: str, exc: BaseException, what: str
) -> bool:
    """An exception nobody expected (a bug of ours or of a library, not Redis's doing), caught
    where ``what`` went wrong: logged as an error at 1, 2, 4, ... occurrences of its type
    there, with its traceback the first time -- a systematic bug logged a traceback per load,
    save or lookup (a review's). Returns whether this one was logged; the caller counts it
    (``internal_errors``)."""
    total = failures.add(f"bug:{where}:{type(exc).__name__}")
    if not total:
        return False
    log.error(
        "%s failed with an unexpected %r (%d so far; a bug: please report it)%s",
        what,
        exc,
        total,
        "" if total == 1 else ", traceback logged at the first",
        exc_info=exc if total == 1 else None,
    )
    return True
