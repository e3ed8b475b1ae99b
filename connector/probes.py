"""When the load policy's figures of the store need measuring again, without a user's request
paying for it: small background reads of stored values (a probe), planned on the scheduler side
and run by every worker rank beside its loads (``probe_reads.py``). A probe reads a few blocks
of a recent hit into staging and writes nothing into the KV cache: whole values
(``ProbeKind.WHOLE``, the figure of asynchronous loads) or band by band (``ProbeKind.BANDS``,
the figure of splits). Its time is a sample like a load's; one that expires or fails is an upper
bound (``figures.py``).

A probe is due when a figure is missing, has too few samples, or follows a store that just
changed (every ``MISSING_INTERVAL_S``: hits are decided on it meanwhile), and at most every
``PROBE_INTERVAL_S`` when it is an upper bound (a load
or probe expired or failed) or older than ``STALE_S``, or when the policy has been recomputing
hits because the store looked too slow -- so a store that got faster again is trusted within
seconds, not after some number of recomputed requests. Sizes alternate between one block
(first: nothing is known of the store yet) and what the store gives in ``PROBE_SECONDS`` by its
figure (at most ``PROBE_MAX_BYTES`` and the hit): the fixed cost shows only where sizes differ,
and the bandwidth only where a probe's bytes take longer than its fixed costs. A store slower
than a block in ``PROBE_SECONDS``, or one whose figure is an upper bound, gets one block, so a
probe never costs a slow store long.

An idle engine runs no step, so no step carries a probe: while none has come for
``IDLE_AFTER_S``, its workers run the probes of a standing order on their own
(``idle_probes.py``; the order, ``ProbePlanner.idle_order``, is sent when it changes), and
the first request after an idle spell waits one step for their samples (``scheduler.py``).

On vLLM's CPU backend a probe waits for a quiet step (no prompt tokens computed, no load or
split in flight, and no request held back for its answer: the next step computes that one's
prompt), for at most ``BUSY_WAIT_S``: there a probe's receiving shares the cores of
the pass it runs beside, and on this VM every recomputed prompt's first token came 5-7% later
than the recomputing server's while probes ran beside them. On a GPU a probe's reads land in
host staging and the pass runs on the device, so a probe runs at once: the simulator
(``scripts/sim_load_policy.py``) found waiting for quiet steps there cost busy engines more
(figures learnt later: auto 1.1-1.3x the best fixed way in cells it had held at 0.9-1.0x)
than a probe's share of the store's link beside the loads in flight, which it does not
model.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from connector.figures import MAX_AGE_S, LoadFit, SplitFit
from kvstore.values.keys import BlockName

# at most one probe this often (seconds), while a figure is missing, and otherwise
MISSING_INTERVAL_S = 0.05
PROBE_INTERVAL_S = 1.0
# a figure older than this is measured again when a probe is possible
STALE_S = 30.0
# the larger of the two probe sizes: what the store gives in this long by its figure (bytes a
# rank reads), and at most
PROBE_SECONDS = 0.25
PROBE_MAX_BYTES = 256 << 20
# the larger size is at least this many blocks (where the hit has them): one block's time is
# mostly fixed costs on a slow store, and two sizes a block apart say little of the rate
MIN_LARGE_BLOCKS = 4
# a figure of fewer samples is measured again at once (every MISSING_INTERVAL_S)
FEW_SAMPLES = 3
# what a probe may take before it ends and says the store is at most that fast
PROBE_TIMEOUT_S = 1.0
# how long a due probe waits for a quiet step before it runs beside a busy one (seconds)
BUSY_WAIT_S = 0.5
# an engine that has run no step for this long is idle: its workers probe on their own
# (``idle_probes.py``), at most this far apart, for at most this long an idle spell (no
# sample older than ``figures.MAX_AGE_S`` is used)
IDLE_AFTER_S = 1.0
IDLE_MAX_INTERVAL_S = STALE_S / 2
IDLE_PROBE_FOR_S = MAX_AGE_S
# A consume-mode handoff recomputed because the store looked slow stays in Redis while the
# probes read it (its blocks are the newest hit's): a consumer deletes every handoff it will
# not load, so without it a store judged slow once was never measured again. It goes once the
# probes have measured the store (``ProbePlanner.needs``), or after this long if they never do
# (a busy machine's steps may come seconds apart: a fixed 3 s hold ran out before the probe
# came, and the figure stayed a bound for good).
PROBE_HOLD_S = 30.0


# whole-value probes a hold keeps track of (a 30 s hold plans at most 600, at 50 ms apart)
_MAX_TRACKED = 1024


class ProbeKind(enum.Enum):
    WHOLE = "whole"  # values read whole, as an asynchronous load reads them
    BANDS = "bands"  # values read band of layers by band, as a split reads them


@dataclass(frozen=True)
class ProbeSpec:
    """Read the blocks ``names`` (positions of one chain, their first KV-cache group's; values
    not there are skipped) into staging, ``kind``-wise, within ``timeout_s``; report the time
    as a figure's sample."""

    kind: ProbeKind
    names: list[BlockName]
    timeout_s: float = PROBE_TIMEOUT_S
    # the planner's number for it, in the order sent: a report says which probe it is about
    probe_id: int = 0


class ProbePlanner:
    """Which probe, if any, the next step's workers run (scheduler side)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._names: list[BlockName] = []  # a recent hit's blocks, as present in Redis
        self._owner: str | None = None  # the request whose hit they are
        self._names_from = 0  # the first probe that read those blocks (by ``probe_id``)
        # whole-value probes planned since the owner's handoff was held for them, and those of
        # them that reported (a planned probe may never run: the worker drops one while another
        # runs, or finds no staging; band probes say nothing of the whole loads' figure)
        self._whole_since_hold: set[int] = set()
        self._reported_since_hold: set[int] = set()
        self._sent_at = -float("inf")
        self._sent = 0  # probes planned so far: the next one's ``probe_id``
        self._store_too_slow = False  # the last hit was recomputed because of the store
        # the idle probes' order in force: its sizes (empty: none in force; every change of
        # ``_names`` retires it), its (negative) ``probe_id``, and the order itself, built
        # once (it is asked for every step)
        self._idle_key: tuple[tuple[ProbeKind, int], ...] = ()
        self._idle_id = 0
        self._idle_specs: tuple[ProbeSpec, ...] = ()
        self._waiting_since: float | None = None  # a probe was due, and no step was quiet

    def remember(self, names: list[BlockName], owner: str) -> None:
        """Blocks a lookup just found in Redis for request ``owner``: what probes read (the
        newest hit's)."""
        if names:
            self._names = list(names)
            self._owner = owner
            self._names_from = self._sent
            self._retire_idle_order()  # (a late report of the old one says nothing of these)

    def missing(self, probe_id: int) -> None:
        """Probe ``probe_id`` found the blocks it read gone (evicted, or a consume-mode handoff
        deleted after its load): no more probes until a lookup finds blocks again -- unless it
        read an older hit's blocks (a report from before the newest lookup says nothing of
        the newest hit's: it wiped them, and let their hold go). An idle probe (a negative
        id) of the order in force read the newest hit's blocks: its worker dropped the order,
        and the next step's says so to every rank."""
        self.reported(probe_id)
        if self._names_from <= probe_id < self._sent or (
            probe_id < 0 and probe_id == self._idle_id
        ):
            self._names = []

    def reported(self, probe_id: int) -> None:
        """Probe ``probe_id`` ended: with a sample, an upper bound, or nothing found."""
        if probe_id in self._whole_since_hold:  # (anything else: not one the hold waits for)
            self._reported_since_hold.add(probe_id)

    def note_choice(self, recomputed_for_the_store: bool) -> None:
        """The policy chose how to serve a measured hit: recomputing it because loading looked
        slower keeps the store under watch."""
        self._store_too_slow = recomputed_for_the_store

    def hold_s(self, owner: str) -> float:
        """How long request ``owner``'s handoff, which it will not load, must stay for the
        probe: while the store is under watch (the last hit was recomputed because of it) and
        its blocks are the ones probes read, whatever its own choice was (pinned, or a load
        vLLM cut short); else 0 (a local hit's, an older hit's)."""
        watched = self._store_too_slow and self._names and owner == self._owner
        if not watched:
            return 0.0
        self._whole_since_hold, self._reported_since_hold = set(), set()
        return PROBE_HOLD_S

    def needs(self, owner: str, loads: LoadFit | None) -> bool:
        """Whether request ``owner``'s held blocks are still what the probes must read: its hit
        is the newest, the store is under watch (the policy has not trusted it since), and
        the probes have not measured it yet -- the figure (``loads``, the whole loads' now) is
        missing, bounded or stale, or fewer than ``FEW_SAMPLES`` whole-value probes planned
        since the hold have reported. (Released after one newer sample, the next probe found
        nothing and stopped: a store measured slow and then fast again kept its slow figure,
        and every hit was recomputed until it went stale; three samples are what a changed
        store's figure follows, ``figures.fixed_and_rate``.)"""
        if owner != self._owner or not self._names or not self._store_too_slow:
            return False
        if loads is None or _needs(loads):
            return True
        return len(self._reported_since_hold) < FEW_SAMPLES

    def due(
        self,
        loads: LoadFit | None,
        splits: SplitFit | None,
        splits_allowed: bool,
        block_bytes: int,
        quiet: bool = True,
    ) -> ProbeSpec | None:
        """The probe to run now, or None. ``quiet``: the step computes no prompt tokens and
        has no load or split in flight (a probe then costs no request anything)."""
        now = self._clock()
        missing = _few(loads) or (splits_allowed and _few(splits))
        interval = MISSING_INTERVAL_S if missing else PROBE_INTERVAL_S
        whole = _needs(loads) or self._store_too_slow
        bands = splits_allowed and (_needs(splits) or self._store_too_slow)
        if (
            not self._names
            or block_bytes <= 0
            or now - self._sent_at < interval
            or not (whole or bands)
        ):
            # none due: a wait for a quiet step ends here (kept, the next probe due beside a
            # busy step ran at once, as if it had waited since: a review)
            self._waiting_since = None
            return None
        if not quiet:
            if self._waiting_since is None:
                self._waiting_since = now
            if now - self._waiting_since < BUSY_WAIT_S:
                return None
        self._waiting_since = None
        kinds = [k for k, needed in ((ProbeKind.WHOLE, whole), (ProbeKind.BANDS, bands)) if needed]
        kind = kinds[self._sent % len(kinds)]
        # small, then large (sized by what the small one said), and so on
        large = (self._sent // len(kinds)) % 2 == 1
        blocks = self._large(kind, loads, splits, block_bytes) if large else 1
        spec = ProbeSpec(kind, self._names[:blocks], probe_id=self._sent)
        if kind is ProbeKind.WHOLE and len(self._whole_since_hold) < _MAX_TRACKED:
            self._whole_since_hold.add(spec.probe_id)
        self._sent_at, self._sent = now, self._sent + 1
        return spec

    def idle_order(
        self,
        loads: LoadFit | None,
        splits: SplitFit | None,
        splits_allowed: bool,
        block_bytes: int,
    ) -> tuple[ProbeSpec, ...]:
        """The probes an idle engine's workers run in turn while no step comes
        (``idle_probes.py``), each kind small then large: where the next hit's choice hangs on
        them -- a figure missing or an upper bound, or the store under watch (the last hit
        recomputed because of it); none (empty) otherwise, or with nothing to read. (A figure
        that is only stale, or has few samples, is the steps' probes' to refresh: idle
        engines sharing a store do not read it for that.) The order keeps its ``probe_id``, a
        negative number, while what it reads is the same."""
        whole = _urgent(loads) or self._store_too_slow
        bands = splits_allowed and (_urgent(splits) or self._store_too_slow)
        kinds = [k for k, needed in ((ProbeKind.WHOLE, whole), (ProbeKind.BANDS, bands)) if needed]
        if not self._names or block_bytes <= 0 or not kinds:
            self._retire_idle_order()  # (also where ``missing`` wiped the names)
            return ()
        sizes = [(k, 1) for k in kinds] + [
            (k, _power_of_two(self._large(k, loads, splits, block_bytes))) for k in kinds
        ]
        key = tuple(sizes)
        if key != self._idle_key:  # (sizes kept to powers of two: a fit moving a little
            self._idle_key, self._idle_id = key, self._idle_id - 1  # sends nothing new)
            self._idle_specs = tuple(
                ProbeSpec(k, self._names[:n], probe_id=self._idle_id) for k, n in sizes
            )
        return self._idle_specs

    def _retire_idle_order(self) -> None:
        """No order is in force: a late report of the last one's probes wipes nothing."""
        if self._idle_key:
            self._idle_key, self._idle_id = (), self._idle_id - 1

    def _large(
        self, kind: ProbeKind, loads: LoadFit | None, splits: SplitFit | None, block_bytes: int
    ) -> int:
        """The larger probe's blocks: what the store gives in ``PROBE_SECONDS`` by the figure
        of ``kind`` (one block while nothing is known, or the figure is an upper bound)."""
        rate = (loads if kind is ProbeKind.WHOLE else splits) or loads
        if rate is None or rate.bounded:
            return 1
        nbytes = min(PROBE_MAX_BYTES, rate.bytes_per_s * PROBE_SECONDS)
        blocks = max(MIN_LARGE_BLOCKS, int(nbytes // block_bytes))
        return max(1, min(len(self._names), blocks))


def _urgent(fit: LoadFit | SplitFit | None) -> bool:
    """No figure, or an upper bound: the next hit's choice hangs on a probe."""
    return fit is None or fit.bounded


def _power_of_two(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


def _needs(fit: LoadFit | SplitFit | None) -> bool:
    return _few(fit) or fit is None or fit.bounded or fit.age_s > STALE_S


def _few(fit: LoadFit | SplitFit | None) -> bool:
    """Too few samples yet, or the newest disagree with the rest (the store changed): two sizes
    tell the fixed cost from the rate, and a third sized by what those say measures the rate
    where the bytes outweigh the fixed costs."""
    return fit is None or fit.samples < FEW_SAMPLES or fit.changed
