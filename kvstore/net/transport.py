"""The store's connections and how bytes travel on them: the one place where a value is sent,
where a reply is received, and where a redirected value is sent again.

Two redis-py clients of the same servers: ``client`` moves values, ``control`` carries the small
latency-critical calls (lookups, handoff records, deletes, pings) on its own pool -- with a
shorter socket timeout when ``LookupBuffer.from_url`` made it -- so they never queue behind
multi-MiB transfers on a slow server.

Values travel on raw pooled connections of ``client`` (``wire``): each SET is sent from the
buffers where its parts lie, each GET reply is received straight into its destination. A batch
is split by :class:`Shards` over the servers holding its keys and over several connections per
server. A value whose slot moved (``MOVED`` / ``ASK``) is sent again through redis-py's cluster
client, which follows the redirection and relearns the slot map.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import redis
from redis.cluster import RedisCluster

from kvstore.errors import StoreBusyError
from kvstore.net.bounded_replies import integer_reply, reply_batch
from kvstore.net.buffer_pool import BufferPool
from kvstore.net.connection import close_client, error_code
from kvstore.net.shards import REDIRECTED, Shards, is_redirect
from kvstore.net.wire import (
    Oversize,
    ReplyReader,
    ReplyTooLarge,
    deadline_passed,
    pack_set,
    parsed_reply_into,
    raw_socket,
    send_buffers,
)

# Replies in flight per connection on reads, unless the caller sets read_depth: at least
# READ_DEPTH, and for smaller values as many as fit in READ_BYTES_IN_FLIGHT (64 KiB values: 16).
# Chosen from scripts/bench_paths.py --sweep across value sizes: large values read fastest 2 to
# 4 deep, small ones with the batch pipelined (one syscall and round trip per value cost more
# than the bytes); see docs/benchmarks.md, "How reads are shaped".
READ_DEPTH = 4
READ_BYTES_IN_FLIGHT = 1 << 20

# Idle bytes of recycled receive buffers kept for select / drop_select (buffer_pool.py): what
# the last batch had in use at once, at least two batches of 16 blocks of Llama-3-8B geometry
# (2 MiB each), at most one batch of 16 values of 16 MiB.
RECYCLE_BYTES = 64 << 20
RECYCLE_CEILING_BYTES = 256 << 20

# One SET: the key, the value's parts (buffers, sent as they lie), its TTL in ms or None.
SetCommand = tuple[bytes, Sequence[Any], int | None]
# Where a GET reply lands: a view of the caller's buffer, or for an int, a new buffer of the
# reply's size up to that many bytes.
Destination = memoryview | int


class Transport:
    def __init__(
        self,
        client: redis.Redis,
        control: redis.Redis | None = None,
        *,
        read_depth: int | None = None,
        threads: int = 8,
        on_redirect: Callable[[], None] = lambda: None,
        recycle_bytes: int = RECYCLE_BYTES,
        recycle_ceiling_bytes: int = RECYCLE_CEILING_BYTES,
    ) -> None:
        self.client = client
        self.control = control or client
        self.shards = Shards(client, others=[self.control], threads=threads)
        # the control calls' fan-out has threads of its own: a lookup never waits behind value
        # transfers queued for a slow master (its relearning is done by self.shards)
        self._control_shards = Shards(self.control, threads=threads, name="kvstore-control")
        # None: by the values' size (READ_DEPTH, more for small values); else exactly this
        self.read_depth = read_depth
        # where replies that are not received into the caller's buffers land (buffer_pool.py)
        # recycle_bytes=0: nothing is kept, whatever a batch had in use
        self.buffers = BufferPool(recycle_bytes, recycle_ceiling_bytes if recycle_bytes else 0)
        self._on_redirect = on_redirect
        # close() closes the clients' pools only when their maker said they are ours
        self.owns_clients = False

    @property
    def cluster(self) -> bool:
        return self.shards.cluster

    # ------------------------------------------------------------------ values
    def set_values(self, commands: Sequence[SetCommand], connections: int = 1) -> None:
        """Send the SETs, spread over the servers and up to ``connections`` connections each;
        raises the first error any server replied (after every reply was read)."""
        sent = self.shards.fan_out(
            self._set_on_one, list(commands), key=lambda c: c[0], connections=connections
        )

        def resend(i: int) -> object:
            key, parts, px = commands[i]
            return self.client.set(key, b"".join(memoryview(p).cast("B") for p in parts), px=px)

        self._follow_redirects(sent, resend)

    def _set_on_one(self, server: redis.Redis, commands: list[SetCommand]) -> list[object]:
        """SETs on one connection to ``server``; per command None, or REDIRECTED."""
        refused: Exception | None = None
        out: list[object] = []
        with self._pooled_connection(server) as conn:
            conn.connect()
            sock = raw_socket(conn)
            if sock is None:  # a client without a socket (fakeredis): plain SETs
                pipe = server.pipeline(transaction=False)
                for key, parts, px in commands:
                    pipe.set(key, b"".join(memoryview(p).cast("B") for p in parts), px=px)
                pipe.execute()
                return [None] * len(commands)
            send_buffers(sock, [b for c in commands for b in pack_set(*c)])
            reader = ReplyReader(sock)
            while len(out) < len(commands):
                ok = reader.skip_ok(len(commands) - len(out))
                out.extend([None] * ok)
                if len(out) == len(commands):
                    break
                try:
                    reader.read_status()  # not +OK: an error, or a status of another kind
                    out.append(None)
                except redis.exceptions.ResponseError as exc:
                    if is_redirect(exc):
                        out.append(REDIRECTED)
                        continue
                    refused = refused or exc  # read the rest, then say so
                    out.append(None)
        if refused is not None:
            raise refused
        return out

    def get_values(
        self,
        commands: Sequence[tuple[Any, ...]],
        dests: Sequence[Destination],
        connections: int = 1,
        each: Callable[[int, Any], Any] | None = None,
        *,
        deadline: float = math.inf,
    ) -> list[Any]:
        """Send ``commands`` (each ``(name, key, ...)`` with a bulk-string reply) and receive
        each reply into its destination, at most ``read_depth`` replies in flight per
        connection (unset: ``READ_DEPTH``, or 1 MiB of smaller values). Per command: the length
        received into a view, the new buffer, None for a missing key, ``wire.Oversize`` for a
        value larger than its destination (drained, never allocated), or -1 for a key of
        another type.

        ``each(index, reply)``, when given, is applied to every reply on the thread that
        received it, as soon as it is received, and its result is returned in the reply's
        place: the caller's check of one value (a checksum) runs while the value is still in
        the CPU cache and while the server sends the next one. It must not raise.

        ``deadline`` (``time.monotonic()``): no reply is waited for past it, however many are
        left (``DeadlinePassedError``; each reply has its own deadline besides)."""
        work = [(i, c, d) for i, (c, d) in enumerate(zip(commands, dests, strict=True))]
        got = self.shards.fan_out(
            lambda server, part: self._get_on_one(server, part, each, deadline=deadline),
            work,
            key=lambda w: w[1][1],
            connections=connections,
            deadline=deadline,
        )

        return self._read_redirected(got, work, each, deadline)

    def _read_redirected(
        self,
        got: list[Any],
        work: list[tuple[int, tuple[Any, ...], Destination]],
        each: Callable[[int, Any], Any] | None,
        deadline: float = math.inf,
    ) -> list[Any]:
        """The values a Cluster node answered MOVED / ASK for, read again from the node the
        slot map names once relearnt, by this transport's bounded reader (redis-py's client
        would follow the redirection and read the reply whole); one redirected again (a slot
        being migrated) is a miss this time. Counted. Returns ``got`` with them in place."""
        redirected = [i for i, reply in enumerate(got) if reply is REDIRECTED]
        if not redirected:
            return got
        for _ in redirected:
            self._on_redirect()
        if not self.shards.relearn_by(deadline):
            raise deadline_passed("while the Cluster's slot map was learnt again")
        again = self.shards.fan_out(
            lambda server, part: self._get_on_one(server, part, each, deadline=deadline),
            [work[i] for i in redirected],
            key=lambda w: w[1][1],
            deadline=deadline,
        )
        for i, reply in zip(redirected, again, strict=True):
            if reply is REDIRECTED:
                reply = each(work[i][0], None) if each is not None else None
            got[i] = reply
        return got

    def script_then_values(
        self,
        script: tuple[Any, ...],
        commands: Sequence[tuple[Any, ...]],
        dests: Sequence[Destination],
        each: Callable[[int, Any], Any] | None = None,
        *,
        script_items: int,
        deadline: float = math.inf,
    ) -> tuple[list[int] | int | None, list[Any]]:
        """One server's connection: ``script`` (an ``EVALSHA`` that answers a table of at most
        ``script_items`` numbers, a number or ``false``), then ``commands`` received as
        :meth:`get_values` receives them. The server runs the commands after the script, and
        the script costs no round trip of its own. Returns the script's reply (None for its
        ``false``) and the commands' replies; an error the script answered is raised after
        every reply was read. Not on a Cluster, where the keys may live on several servers."""
        if self.cluster:
            raise TypeError("script_then_values serves one server, not a Cluster")
        work = [(i, c, d) for i, (c, d) in enumerate(zip(commands, dests, strict=True))]
        first: list[list[int] | int | None] = []
        got = self._get_on_one(
            self.client,
            work,
            each,
            script=script,
            script_reply=first,
            script_items=script_items,
            deadline=deadline,
        )
        return first[0], got

    def _get_on_one(
        self,
        server: redis.Redis,
        work: list[tuple[int, tuple[Any, ...], Destination]],
        each: Callable[[int, Any], Any] | None,
        *,
        script: tuple[Any, ...] | None = None,
        script_reply: list[list[int] | int | None] | None = None,
        script_items: int = 0,
        deadline: float = math.inf,
    ) -> list[Any]:
        """``work``'s replies on one connection to ``server``; with ``script``, that command
        goes first, in the same send, and its reply is appended to ``script_reply``. A value
        too large to drain is a miss (``Oversize``): its connection is dropped and the replies
        after it are read on another one, so one planted value costs the batch one
        reconnection, not its other values."""
        out: list[Any] = []
        while True:
            got, work = self._read_on_one(
                server, work, each, script, script_reply, script_items, deadline
            )
            out += got
            if not work:
                return out
            script = None  # (it ran: its reply came before the value too large)

    def _read_on_one(
        self,
        server: redis.Redis,
        work: list[tuple[int, tuple[Any, ...], Destination]],
        each: Callable[[int, Any], Any] | None,
        script: tuple[Any, ...] | None,
        script_reply: list[list[int] | int | None] | None,
        script_items: int = 0,
        deadline: float = math.inf,
    ) -> tuple[list[Any], list[tuple[int, tuple[Any, ...], Destination]]]:
        """As :meth:`_get_on_one`, on one connection; returns the replies read and the work
        left to read elsewhere (after a value too large to drain, whose reply ends it)."""
        out: list[Any] = []
        left: list[tuple[int, tuple[Any, ...], Destination]] = []
        refused: Exception | None = None
        # a value's size: its destination's, else (a new buffer) the last reply's, once known
        value_bytes = len(work[0][2]) if work and isinstance(work[0][2], memoryview) else 0
        # (checked before a pooled connection is taken, and dropped: redis-py's pool makes and
        # connects one there, its handshake on the socket timeout alone -- not bounded here)
        if time.monotonic() >= deadline:
            raise deadline_passed("before connecting")
        with self._pooled_connection(server, deadline) as conn:
            conn.connect()
            sock = raw_socket(conn)
            # a script's own reply is waited for as ever, past the deadline: a claim the caller
            # stopped waiting for could still run after what it took was given back (a review:
            # values left under claim keys); it refuses to run late by itself, within the reply
            # timeout (``values/drop_select.py``). The values after it keep the deadline.
            reader = (
                ReplyReader(sock, deadline=math.inf if script is not None else deadline)
                if sock is not None
                else None
            )
            sent = 0
            if script is not None:
                sent = min(len(work), self._depth(value_bytes))
                conn.send_packed_command(
                    conn.pack_commands([script, *(c for _, c, _ in work[:sent])])
                )
                try:
                    if reader is None:  # a client without a socket (fakeredis): parsed
                        answer = conn.read_response()
                        if isinstance(answer, Exception):
                            raise answer
                        reply_of_script = (
                            answer
                            if answer is None or isinstance(answer, int)
                            else [int(v) for v in answer]
                        )
                    else:
                        reply_of_script = reader.read_int_array(script_items)
                except redis.exceptions.ResponseError as exc:
                    refused, reply_of_script = exc, None  # read the rest, then say so
                assert script_reply is not None
                script_reply.append(reply_of_script)
                if reader is not None:
                    reader.limit_to(deadline)
            for i, (index, _, dest) in enumerate(work):
                upto = min(len(work), i + self._depth(value_bytes))  # replies kept in flight
                if upto > sent:
                    if time.monotonic() >= deadline:  # (what would answer is not read)
                        raise deadline_passed("before sending more")
                    # redis-py checks a connection's health on a send (a PING, every 30 s):
                    # only on the first, while no reply of ours is in flight to be taken for
                    # the PONG
                    conn.send_packed_command(
                        conn.pack_commands([c for _, c, _ in work[sent:upto]]),
                        check_health=sent == 0,
                    )
                    sent = upto
                try:
                    if reader is None:  # a client without a socket (fakeredis): parsed reply
                        reply: Any = parsed_reply_into(conn.read_response(), dest)
                    elif isinstance(dest, memoryview):
                        reply = reader.read_bulk_into(dest)
                    else:
                        reply = reader.read_bulk_new(dest, self.buffers.take)
                except ReplyTooLarge as exc:
                    # its bytes were not read: this connection's place in the stream is lost
                    conn.disconnect()
                    reply, left = Oversize(exc.length), work[i + 1 :]
                except redis.exceptions.ResponseError as exc:
                    if is_redirect(exc) and not self.cluster:
                        # (redis-py would follow it, reading the reply whole, unbounded)
                        raise redis.exceptions.InvalidResponse(
                            f"a standalone server answered {str(exc)[:60]!r} for a value read: "
                            "not a Cluster's answer, so the connection is dropped; is the URL "
                            "a Cluster node's? Use redis-cluster:// for a Cluster"
                        ) from None
                    if is_redirect(exc):
                        out.append(REDIRECTED)
                        continue
                    if error_code(exc) != "WRONGTYPE":
                        refused = refused or exc  # read the rest, then say so
                    reply = -1
                if isinstance(reply, int) and reply > 0:
                    value_bytes = reply
                elif isinstance(reply, memoryview):
                    value_bytes = len(reply)
                out.append(each(index, reply) if each is not None else reply)
                if left:
                    break
        if refused is not None:
            raise refused
        return out, left

    def _depth(self, value_bytes: int) -> int:
        """How many replies to keep in flight for values of ``value_bytes`` (0: not known)."""
        if self.read_depth is not None:
            return self.read_depth
        return max(READ_DEPTH, READ_BYTES_IN_FLIGHT // value_bytes) if value_bytes else READ_DEPTH

    @contextlib.contextmanager
    def _pooled_connection(self, server: redis.Redis, deadline: float = math.inf) -> Iterator[Any]:
        """A connection of ``server``'s pool, for reading replies ourselves. If the body raises
        before every reply was read, the connection's place in the reply stream is lost: it is
        dropped, not returned to the pool as it is. The pool's wait for a free connection is
        its own (the socket timeout), cut short at ``deadline``: then the deadline's error."""
        pool = server.connection_pool
        by = getattr(pool, "get_connection_by", None)  # (ours: the wait ends by the deadline)
        try:
            conn = by(deadline) if by is not None else pool.get_connection()
        except StoreBusyError:
            if time.monotonic() >= deadline:  # (a load past its deadline, not a short pool)
                raise deadline_passed("waiting for a free connection") from None
            raise
        if time.monotonic() >= deadline:
            pool.release(conn)
            raise deadline_passed("waiting for a free connection")
        try:
            yield conn
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)

    # ------------------------------------------------------------------ small calls
    def pipeline(self, fill: Callable[[Any], None]) -> list[Any]:
        """Small single-key commands on the control client, in one round trip: ``fill`` calls
        redis-py's command methods (``pipe.exists(key)``, ...) on what it is given, and the
        replies come back in that order.

        On a Cluster the commands go to each master's own connection, the masters in parallel,
        not through redis-py's cluster pipeline: that one sends every command that timed out
        again, one by one, each waiting out its own timeout (a hung master cost 8 timeouts for
        one lookup). Here a timeout or a dropped connection fails the call once; a command
        whose slot moved is sent again through the cluster client, which follows the move."""
        if not self.cluster:
            pipe = self.control.pipeline(transaction=False)
            fill(pipe)
            with reply_batch():  # (the replies bounded together: bounded_replies.py)
                return list(pipe.execute())
        recorder = _CommandRecorder()
        fill(recorder)
        calls = recorder.calls
        got = self._control_shards.fan_out(_pipelined, calls, key=lambda c: c[1][0])

        def resend(i: int) -> Any:
            name, args, kwargs = calls[i]
            return getattr(self.control, name)(*args, **kwargs)

        return self._follow_redirects(got, resend)

    def _follow_redirects(self, got: list[Any], resend: Callable[[int], Any]) -> list[Any]:
        """Each item a server answered MOVED / ASK for, sent again with ``resend(index)``
        through a redis-py client, which follows the redirection and relearns the slot map;
        counted. Returns ``got`` with those replies in place."""
        for i, reply in enumerate(got):
            if reply is REDIRECTED:
                self._on_redirect()
                got[i] = resend(i)
        return got

    def unlink(self, keys: Sequence[str]) -> int:
        """``UNLINK`` the keys (of any slots); how many existed."""
        if not self.cluster:
            return integer_reply(self.control.unlink(*keys), "UNLINK") if keys else 0

        def fill(pipe: Any) -> None:
            for key in keys:
                pipe.unlink(key)

        return sum(integer_reply(n, "UNLINK") for n in self.pipeline(fill))

    def ping(self) -> object:
        """Is the store serving? Every master of a Cluster must answer (one that is down and not
        yet replaced makes a third of the keys fail), else the one server."""
        if self.cluster:
            return self.control.ping(target_nodes=RedisCluster.PRIMARIES)
        return self.control.ping()

    def relearn(self) -> None:
        self.shards.relearn()

    def close(self) -> None:
        self.shards.close()
        self._control_shards.close()
        self.buffers.close()
        if self.owns_clients:
            for client in dict.fromkeys((self.client, self.control)):
                close_client(client)


# One recorded command: redis-py's method name, its arguments (the key first), its keywords.
_Call = tuple[str, tuple[Any, ...], dict[str, Any]]


class _CommandRecorder:
    """Stands in for a pipeline while ``fill`` names its commands, so they can be routed: each
    command takes its key as its first positional argument."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []

    def __getattr__(self, name: str) -> Callable[..., _CommandRecorder]:
        def record(*args: Any, **kwargs: Any) -> _CommandRecorder:
            if not args or not isinstance(args[0], (str, bytes)):
                raise TypeError(f"{name}: a routed command takes its key first, got {args!r}")
            self.calls.append((name, args, kwargs))
            return self  # chained like a pipeline's methods

        return record


def _pipelined(server: redis.Redis, calls: list[_Call]) -> list[Any]:
    """``calls`` in one pipeline on one master; REDIRECTED where the slot moved."""
    pipe = server.pipeline(transaction=False)
    for name, args, kwargs in calls:
        getattr(pipe, name)(*args, **kwargs)
    with reply_batch():
        replies = pipe.execute(raise_on_error=False)
    out: list[Any] = []
    for reply in replies:
        if isinstance(reply, Exception):
            if not is_redirect(reply):
                raise reply
            reply = REDIRECTED
        out.append(reply)
    return out
