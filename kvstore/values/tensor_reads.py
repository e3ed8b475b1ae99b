"""Reads of a value's tensors a range at a time (``GETRANGE``): first its header with the
first tensors, then later tensors on their own, each verified against the header's per-tensor
checksums as it arrives. What a caller needs that must have some tensors of many values before
it can use the rest -- a model's first layers of every block of a prefix before the layer runs.

A value is read this way only when it lies where the caller expects it: its header exactly
``header_bytes`` long (the caller's own framing of the layout), uncompressed, with per-tensor
checksums, its tensors the caller's. Any other value is reported ``WHOLE`` (read it whole with
``select_into``: written by an older version, compressed, another header length). Nothing read
is trusted: a reply is received into the caller's buffer and never beyond it, a short reply or
a checksum that does not match is a counted miss, and a later range is checked against the
header read first -- a value replaced in between fails its next range.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.counters import Counters
from kvstore.errors import CorruptValueError
from kvstore.net.guard import Guard
from kvstore.net.transport import Transport
from kvstore.net.wire import Oversize
from kvstore.values.codec import (
    TensorEntry,
    ValueHeader,
    _read_header,
    tensor_checksums_ok,
)
from kvstore.values.value_auth import ValueKey

# how bad values are reported (``Reader.log_bad``: each key warned about once)
BadValueLog = Callable[[list[tuple[str, CorruptValueError]]], None]


class HeadMiss(enum.Enum):
    """Why a head read gave no header to read more ranges of."""

    MISSING = "missing"  # no such key (GETRANGE answers an empty string)
    INVALID = "invalid"  # not a valid value of this layout: a counted miss
    WHOLE = "whole"  # valid as far as seen, but not readable by ranges here: read it whole


class TensorReader:
    def __init__(
        self,
        transport: Transport,
        guard: Guard,
        counters: Counters,
        *,
        fingerprint: str,
        max_value_bytes: int,
        log_bad: BadValueLog,
        value_key: ValueKey | None = None,
    ) -> None:
        self._value_key = value_key
        self._transport = transport
        self._guard = guard
        self._counters = counters
        self._fingerprint = fingerprint
        self._max_value_bytes = max_value_bytes
        self._log_bad = log_bad

    def read_head(
        self,
        hashes: Sequence[str],
        keys: Sequence[str],
        views: Sequence[memoryview],
        *,
        header_bytes: int,
        entries: Sequence[TensorEntry],
        tensors: int,
        connections: int = 1,
        deadline: float = math.inf,
    ) -> list[ValueHeader | HeadMiss]:
        """Receive bytes ``[0, header_bytes + tensors' bytes)`` of each key into its view (at
        least that long): the header, then tensors ``[0, tensors)`` of ``entries`` (the layout
        the caller expects, offsets included). Per key: the verified header, or why not. No
        reply is waited for past ``deadline`` (``DeadlinePassedError``)."""
        if not 0 < tensors <= len(entries):
            raise ValueError(f"tensors must be in [1, {len(entries)}], got {tensors}")
        want = header_bytes + entries[tensors - 1].end
        layout = tuple(entries)

        def check(i: int, got: Any) -> ValueHeader | HeadMiss | CorruptValueError:
            return self._check_head(hashes[i], got, views[i], header_bytes, want, layout, tensors)

        commands = [("GETRANGE", k, 0, want - 1) for k in keys]
        dests = [v[:want] for v in views]
        checked = self._guard.call(
            "GETRANGE",
            lambda: self._transport.get_values(
                commands, dests, connections, check, deadline=deadline
            ),
        )
        out: list[ValueHeader | HeadMiss] = []
        bad: list[tuple[str, CorruptValueError]] = []
        for key, c in zip(keys, checked, strict=True):
            if isinstance(c, CorruptValueError):
                bad.append((key, c))
                out.append(HeadMiss.INVALID)
            else:
                out.append(c)
        hits = sum(1 for c in out if isinstance(c, ValueHeader))
        misses = sum(1 for c in out if c in (HeadMiss.MISSING, HeadMiss.INVALID))
        self._counters.add_reads(hits, misses, hits * want, [e.reason for _, e in bad])
        if bad:
            self._log_bad(bad)
        return out

    def _check_head(
        self,
        block_hash: str,
        got: Any,
        view: memoryview,
        header_bytes: int,
        want: int,
        layout: tuple[TensorEntry, ...],
        tensors: int,
    ) -> ValueHeader | HeadMiss | CorruptValueError:
        """One head reply, checked on the thread that received it; never raises."""
        if got is None or got == 0:
            return HeadMiss.MISSING
        if isinstance(got, Oversize) or not isinstance(got, int) or got < 0:
            # more than asked for (no Redis does that) or not a string
            return CorruptValueError("wrong-type", "the key does not hold a value of this range")
        data = view[:got]
        try:
            header, _ = _read_header(
                data, self._max_value_bytes, whole=False, value_key=self._value_key
            )
        except CorruptValueError as exc:
            # a header longer than the range read is valid but not where it was expected
            return HeadMiss.WHOLE if exc.reason == "truncated" else exc
        except Exception as exc:  # a header the checks let through: still a bad value
            return CorruptValueError("not-kvstore", f"header decodes with {type(exc).__name__}")
        if header.fingerprint != self._fingerprint:
            return CorruptValueError(
                "fingerprint", f"value has layout fingerprint {header.fingerprint}"
            )
        if header.block_name != block_hash:
            return CorruptValueError("key", f"value was written for block {header.block_name}")
        if (
            header.header_bytes != header_bytes
            or header.codec != "none"
            or not header.tensor_checksums
        ):
            return HeadMiss.WHOLE
        if header.tensors != layout:
            return CorruptValueError("layout", "its tensors are not this layout's")
        if got != want:
            return CorruptValueError("truncated", f"{got} bytes of the {want} asked for")
        if not tensor_checksums_ok(header, 0, tensors, data[header_bytes:want], self._value_key):
            return CorruptValueError("checksum", "a tensor checksum does not match")
        return header

    def read_tensors(
        self,
        hashes: Sequence[str],
        keys: Sequence[str],
        headers: Sequence[ValueHeader],
        views: Sequence[memoryview],
        first: int,
        end: int,
        *,
        connections: int = 1,
        deadline: float = math.inf,
    ) -> list[bool]:
        """Receive tensors ``[first, end)`` of each key (back to back, from the start of its
        view) as its ``header`` -- from :meth:`read_head` -- places them, and verify them
        against the header's checksums. Per key: whether they arrived intact. No reply is
        waited for past ``deadline`` (``DeadlinePassedError``)."""
        spans = []
        for h in headers:
            if not 0 <= first < end <= len(h.tensors):
                raise ValueError(f"tensors [{first}, {end}) are not in the value's")
            base = h.header_bytes
            spans.append((base + h.tensors[first].start, base + h.tensors[end - 1].end))

        def check(i: int, got: Any) -> CorruptValueError | None:
            start, stop = spans[i]
            if got is None or got == 0:
                return CorruptValueError("truncated", "the value is gone")
            if isinstance(got, Oversize) or not isinstance(got, int) or got != stop - start:
                return CorruptValueError("truncated", "the value is not the one read first")
            if not tensor_checksums_ok(headers[i], first, end, views[i][:got], self._value_key):
                return CorruptValueError("checksum", "a tensor checksum does not match")
            return None

        commands = [("GETRANGE", k, a, b - 1) for k, (a, b) in zip(keys, spans, strict=True)]
        dests = [v[: b - a] for v, (a, b) in zip(views, spans, strict=True)]
        checked = self._guard.call(
            "GETRANGE",
            lambda: self._transport.get_values(
                commands, dests, connections, check, deadline=deadline
            ),
        )
        bad = [(k, c) for k, c in zip(keys, checked, strict=True) if c is not None]
        nbytes = sum(b - a for (a, b), c in zip(spans, checked, strict=True) if c is None)
        self._counters.add_range_reads(nbytes, [c.reason for _, c in bad])
        if bad:
            self._log_bad(bad)
        return [c is None for c in checked]
