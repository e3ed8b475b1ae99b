"""What the scheduler side keeps of one request (``RequestState``): where it is in its life
(``Phase``, described callback by callback in ``scheduler.py``), where it is with a producer's
handoff (``HandoffState``), and what its saves have written so far (``save_plans.py``).

Every change of state is a method here, named for the event that causes it, so the modules that
drive a request (``scheduler.py``, ``lookup_polls.py``, ``save_plans.py``, ...) never assign its
fields; they read them freely. Nothing here talks to Redis or imports vLLM.
"""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from connector.layout import ChainNames
from connector.load_policy import Decision, Hit, Way
from connector.lookups import Lookup
from connector.transfer_params import Handoff


class Phase(enum.Enum):
    LOOKING_UP = "looking up"
    # looked up, and not answered yet: its split waits for a pass free of another split, and
    # vLLM asks again next step (``load_policy.Reason.AFTER_THIS_PASS``)
    WAITING_A_PASS = "waiting a pass"
    ANSWERED = "answered"
    LOADING = "loading"
    RUNNING = "running"


class CountedOnce(enum.Enum):
    """What is counted once per admission of a request (again after a preemption), however
    often it is asked about again meanwhile (its local hits shrank and it is looked up anew)."""

    CHOICE = "the load policy's choice"
    GIVE_UP = "giving up on Redis"


class HandoffState(enum.Enum):
    """Where a consumer is with its producer's handoff: WAITING -> LOADING (the worker claims
    it) | DROPPED (we claim and delete it unloaded, ``drops.py``) | TAKEN (another request
    claimed it first)."""

    WAITING = "waiting"
    LOADING = "loading"
    DROPPED = "dropped"
    TAKEN = "taken"


@dataclass
class RequestState:
    """What the scheduler keeps of one request: its state machine's, and its saves' (planned by
    ``save_plans.SavePlanner`` each step)."""

    num_tokens: int  # prompt tokens
    # the chains' block names, every group's, named once: what loads look up (the handoff's
    # chain, or the shared one) and what saves write (ours; the same object when they share it)
    load_names: ChainNames
    save_names: ChainNames
    save_handoff: str  # the id our commit record is published under
    deadline: float
    handoff: Handoff | None = None  # an incoming handoff to wait for
    handoff_state: HandoffState = HandoffState.WAITING  # (of ``handoff``, if any)
    phase: Phase = Phase.LOOKING_UP
    first_seen: float = field(default_factory=time.monotonic)
    lookup: Lookup | None = None
    lookup_start: int = 0  # the first block the lookup in flight asks about
    next_poll: float = 0.0  # no new lookup before this time
    present_blocks: int = 0  # the answer: leading blocks present (absolute)
    load_end: int = 0  # the answer: where the blocks it loads end (absolute; the policy's)
    layered: bool = False  # the answer is a split (a synchronous, layer-by-layer load)
    decision: Decision | None = None  # how the load policy served the hit, and why
    pin: Way | None = None  # the way the request's own params pinned (request_load_policy)
    # where its wait for the samples of the workers' idle probes began (``idle_probes.py``,
    # ``LoadChoices.wait_mark``; None: it did not wait)
    idle_wait_from: tuple[int, int] | None = None
    waited_a_pass: bool = False  # this admission's split waited a pass once (never twice)
    pass_to_give_back: bool = False  # ... and that wait is not yet given back to its deadline
    answer_start: int = 0  # vLLM's local hit (blocks) the answer was given for
    answered_at: float = 0.0
    load_range: tuple[int, int] = (0, 0)
    block_ids: list[list[int]] = field(default_factory=list)  # per KV-cache group
    computed_tokens: int = 0  # what its last scheduled step leaves computed (vLLM's view)
    saved_blocks: int = 0  # leading blocks of save_names saved or known to be in Redis
    save_start: int | None = None  # saved_blocks when the first save was planned
    opening: Future[None] | None = None  # the "pending" record being written
    preemptions: int = 0
    # (group, chain position) of the states saved from vLLM's offers (state groups)
    states_saved: set[tuple[int, int]] = field(default_factory=set)
    generation: int = 0  # the namespace's generation its chains are named in
    # share mode, all of it a local hit: the lookup that says what Redis holds of its chain,
    # which its saves wait for (None: known, or not asked)
    presence: Lookup | None = None
    # share mode: whether its caller asked for it to be written (save_policy.py), and how many
    # leading blocks the save policy lets it write (None: not decided yet), and the blocks
    # beyond that counted as skipped so far
    save_marked: bool = False
    save_allowance: int | None = None
    save_skipped_to: int = 0
    counted: set[CountedOnce] = field(default_factory=set)  # this admission's, so far
    # the load policy's last decision for it, its hit, and whether the policy chose (not a
    # pinned way): counted once it takes effect (``LoadChoices.count_choice``)
    chosen: tuple[Decision, Hit, bool] | None = None

    # ------------------------------------------------------------------ what it is
    def renamable(self) -> bool:
        """Nothing of it is in flight or planned yet: its chains may be named again."""
        return (
            self.phase in (Phase.LOOKING_UP, Phase.WAITING_A_PASS)
            and self.save_start is None
            and self.load_range == (0, 0)
            and (self.handoff is None or self.handoff_waiting)
        )

    @property
    def same_chain(self) -> bool:
        return self.load_names is self.save_names

    @property
    def running(self) -> bool:
        """In ``Phase.RUNNING``: what its steps compute may be saved (``save_plans.py``)."""
        return self.phase is Phase.RUNNING

    @property
    def handoff_waiting(self) -> bool:
        """It has a handoff, neither loaded, dropped nor taken by another request yet."""
        return self.handoff is not None and self.handoff_state is HandoffState.WAITING

    def record_opened(self) -> bool:
        """Whether the background write of its "pending" record has landed."""
        fut = self.opening
        return fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None

    # ------------------------------------------------------------------ lookups and answers
    def preempted(self, preemptions: int, deadline: float) -> None:
        """vLLM preempted it: it starts over with a fresh budget (a handoff it loaded or
        dropped is never waited for again)."""
        self.preemptions = preemptions
        self.deadline = deadline
        self.phase, self.lookup, self.next_poll = Phase.LOOKING_UP, None, 0.0
        self.load_range, self.layered, self.decision = (0, 0), False, None
        self.counted.clear()
        self.chosen = None
        self.waited_a_pass = self.pass_to_give_back = False

    def count_once(self, what: CountedOnce) -> bool:
        """Whether ``what`` is to be counted now: the first time this admission."""
        first = what not in self.counted
        self.counted.add(what)
        return first

    def lookup_sent(self, lookup: Lookup, start: int) -> None:
        self.lookup_start, self.lookup = start, lookup

    def lookup_dropped(self) -> None:
        """Its lookup is answered, or no longer asks what is needed."""
        self.lookup = None

    def poll_again_at(self, when: float) -> None:
        self.next_poll = when

    def handoff_taken(self) -> None:
        """Another request claimed its handoff first."""
        self.handoff_state = HandoffState.TAKEN

    def local_hits_shrank(self) -> None:
        """vLLM asks again from fewer local blocks: the blocks before its answer are unknown."""
        self.phase = Phase.LOOKING_UP

    def lookup_kept_for_saves(self) -> None:
        """All of it a local hit: its lookup says what its saves need not write again."""
        self.presence, self.lookup = self.lookup, None

    def answered(self, start: int, present_blocks: int) -> None:
        """vLLM was answered for a local hit of ``start`` blocks."""
        self.phase, self.answer_start, self.answered_at = Phase.ANSWERED, start, time.monotonic()
        self.present_blocks = present_blocks

    def asked_after_a_pass(self, now: float) -> None:
        """Asked again after its answer waited a pass (``Phase.WAITING_A_PASS``): the wait
        until now is not Redis's, and is given back to its deadline, once (what it waits for
        Redis from here on -- another request's load of its blocks -- counts)."""
        if self.pass_to_give_back:
            self.deadline += max(0.0, now - self.answered_at)
            self.pass_to_give_back = False

    def waits_a_pass(self) -> None:
        """Looked up, but its answer waits a step (``Phase.WAITING_A_PASS``), once."""
        self.phase, self.waited_a_pass = Phase.WAITING_A_PASS, True
        self.pass_to_give_back = True

    def decided(self, decision: Decision | None, load_end: int) -> None:
        """The load policy's choice for its hit (None: nothing to load)."""
        self.decision = decision
        self.layered = decision is not None and decision.way is Way.SPLIT
        self.load_end = load_end

    def answer(self, start: int, block_size: int) -> tuple[int, bool]:
        """What vLLM is told for a local hit of ``start`` blocks: the tokens to load, and whether
        asynchronously; the blocks it would load are kept (``load_range``)."""
        n = self.load_end
        if n <= start:
            self.load_range = (start, start)
            return 0, False
        self.load_range = (start, n)
        return (n - start) * block_size, not self.layered

    # ------------------------------------------------------------------ admission and loads
    def allocated(self, block_ids: list[list[int]]) -> None:
        """Its block table now (per KV-cache group)."""
        self.block_ids = block_ids

    def blocks_appended(self, more: list[list[int]]) -> None:
        for ids, added in zip(self.block_ids, more, strict=True):
            ids.extend(added)

    def scheduled(self, computed_tokens: int) -> None:
        """What the step just scheduled leaves computed."""
        self.computed_tokens = computed_tokens

    def admitted_unanswered(self) -> None:
        """Admitted without an answer from us: nothing to load."""
        self.lookup, self.present_blocks, self.load_range = None, 0, (0, 0)

    def start_running(self) -> None:
        self.phase = Phase.RUNNING

    def load_planned(self, start: int, end: int, now: float) -> None:
        """Its blocks ``[start, end)`` are loaded: asynchronously (LOADING), or in this very
        step as a split (RUNNING: its blocks are vLLM's cached blocks at once)."""
        self.deadline += now - self.answered_at  # waiting for room in the KV cache is not Redis
        self.load_range = (start, end)
        self.phase = Phase.RUNNING if self.layered else Phase.LOADING

    def handoff_claimed(self) -> str:
        """The worker claims its handoff as it loads it: the claim's id."""
        assert self.handoff is not None
        self.handoff_state = HandoffState.LOADING
        return self.handoff.handoff_id

    def handoff_dropped(self) -> None:
        """Claimed and deleted unloaded (``drops.py``)."""
        self.handoff_state = HandoffState.DROPPED

    def load_released(self) -> None:
        self.load_range = (0, 0)

    def recomputed_from(self, position: int) -> None:
        """vLLM recomputes its blocks from chain position ``position`` on (a failed load): share
        mode saves them again, so a bad value in Redis is replaced."""
        self.saved_blocks = min(self.saved_blocks, position)
        self.present_blocks = min(self.present_blocks, position)

    # ------------------------------------------------------------------ saves
    def saved_up_to(self, blocks: int) -> None:
        """Its first ``blocks`` blocks are saved, planned to be, or known to be in Redis."""
        self.saved_blocks = max(self.saved_blocks, blocks)

    def presence_settled(self) -> None:
        """Its saves wait no longer for the lookup of what Redis holds of its chain."""
        self.presence = None

    def found_in_redis(self, blocks: int) -> None:
        """Redis holds the first ``blocks`` blocks of its chain: they are not saved again."""
        self.present_blocks = max(self.present_blocks, blocks)
        self.saved_blocks = max(self.saved_blocks, blocks)

    def saves_allowed(self, blocks: int) -> None:
        """The save policy lets it write its first ``blocks`` blocks."""
        self.save_allowance = blocks

    def saves_skipped_to(self, blocks: int) -> None:
        """Its blocks up to ``blocks`` past its allowance are counted as skipped."""
        self.save_skipped_to = blocks

    def saves_opened(self, opening: Future[None]) -> None:
        """Its first save is planned; ``opening`` writes its "pending" record."""
        self.save_start = self.saved_blocks
        self.opening = opening

    def state_saved(self, group: int, position: int) -> None:
        """A state vLLM offered (state groups) is saved at ``position``."""
        self.states_saved.add((group, position))
