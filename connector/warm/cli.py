"""``python -m connector.warm`` / ``vllm-redis-warm``: store a corpus's KV in the shared pool
before anyone asks, re-run it cheaply, and check what is still there.

    python -m connector.warm --model MODEL --url URL [engine options] DOC...
    python -m connector.warm --url URL --check [--model MODEL] [DOC...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from connector.config import MAX_TTL_S, MIN_TTL_S
from connector.warm.inputs import Document, PromptStyle, read_documents, render
from connector.warm.records import (
    DocumentRecord,
    RecordProblem,
    RecordTooLargeError,
    presences,
    read_records,
    save_record,
)
from kvstore import KVStoreError, LookupBuffer, chain_hashes
from kvstore.cli import human_size
from kvstore.text import shown
from kvstore.values.keys import block_name, in_generation

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from connector.warm.engine import StoreLayout, WarmEngine

DEFAULT_TTL_S = 86_400.0
# how long a finished document waits for the connector to confirm its writes
COMMIT_WAIT_S = 120.0
# a document whose writes came up short (saves shed or failed) is prefilled again this often
RETRIES = 2
# every call of the warm command names the engine's fingerprints explicitly; this one is unused
_ANY_FINGERPRINT = "warm"
OPERATIONS = ["ping", "lookup", "block_info", "renew", "insert", "handoff_read"]
# malformed records named in the table's report (--json lists them all)
SHOWN_PROBLEMS = 20


class NothingDone(Exception):
    """A problem found before any work (arguments, Redis down or refusing): exit status 2."""


@dataclass
class Row:
    """One document's line in the report."""

    document: str
    status: str  # stored | present | partial | short | failed | (check:) complete, ...
    tokens: int = 0
    blocks: int = 0
    present: int = 0  # blocks already in the pool before (warm) / now (check)
    stored: int = 0
    bytes: int = 0
    seconds: float = 0.0
    ttl_s: float | None = None
    message: str = ""
    # work in progress (not reported)
    token_ids: list[int] = field(default_factory=list, repr=False)
    chain: list[str] = field(default_factory=list, repr=False)
    doc: Document | None = field(default=None, repr=False)
    started: float = field(default=0.0, repr=False)
    handoff: str | None = field(default=None, repr=False)
    finished: float = field(default=0.0, repr=False)
    attempts: int = field(default=0, repr=False)

    def report(self) -> dict[str, Any]:
        out = {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k not in ("token_ids", "chain", "doc", "started", "handoff", "finished", "attempts")
        }
        out["seconds"] = round(self.seconds, 3)
        return out


# ---------------------------------------------------------------------------------------- args
def _ttl_s(text: str) -> float:
    """--ttl: 0 (no expiry) or the connector's range (NaN and inf were tracebacks; 0.0001
    became a TTL of 0 ms, written as none)."""
    value = float(text)
    if value != 0 and not MIN_TTL_S <= value <= MAX_TTL_S:
        raise argparse.ArgumentTypeError(
            f"{text}: give 0 (no expiry) or {MIN_TTL_S:g} to {MAX_TTL_S:g} seconds"
        )
    return value


def _at_least_one(text: str) -> int:
    """--in-flight: 0 or less spun for ever at full CPU, warming nothing."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: give 1 or more")
    return value


def _own_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("connector.warm")
    g.add_argument("documents", nargs="*", metavar="DOC", help="files, directories, globs, .jsonl")
    g.add_argument(
        "--url",
        help="the store URL the serving instances use (default: the one in their "
        "--kv-transfer-config, else $KVSTORE_URL, which keeps a password out of the process list)",
    )
    g.add_argument("--namespace", help="the serving instances' namespace (default: vllm)")
    g.add_argument(
        "--ttl",
        type=_ttl_s,
        default=DEFAULT_TTL_S,
        help="seconds the blocks live, renewed on every run (0: no expiry, never evicted under "
        "volatile-ttl) (default: %(default)s)",
    )
    g.add_argument("--prefix", default="", help="text before each document in the requests")
    g.add_argument("--suffix", default="", help="text after each document in the requests")
    g.add_argument("--chat", action="store_true", help="render as a chat request (user message)")
    g.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template (implies --chat)")
    g.add_argument("--system", help="a system message before the document (implies --chat)")
    g.add_argument("--text-field", default="text", help="JSONL: the field holding the text")
    g.add_argument("--id-field", default="id", help="JSONL: the field naming the document")
    g.add_argument("--in-flight", type=_at_least_one, default=8, help="documents prefilled at once")
    g.add_argument("--check", action="store_true", help="report what is still in the pool")
    g.add_argument("--json", action="store_true", help="print JSON instead of a table")
    g.add_argument("--verbose", action="store_true", help="show vLLM's own log")


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Our options, and vLLM's engine options (those of ``vllm serve``) for warming."""
    if "--check" in argv:
        ap = argparse.ArgumentParser(prog="python -m connector.warm", description=__doc__)
        _own_arguments(ap)
        ap.add_argument("--model", help="only this model's documents")
        return ap.parse_args(argv), {}
    if "--verbose" not in argv:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # stdout is the report (a table, or JSON for scripts); vLLM logs to stdout by default
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ap = FlexibleArgumentParser(
        prog="python -m connector.warm",
        description=__doc__ + "\nEngine options are vllm serve's: give the serving instances' "
        "values (model, dtype, tensor parallel size, ...), since they decide the keys.",
    )
    _own_arguments(ap)
    EngineArgs.add_cli_args(ap)
    args = ap.parse_args(list(argv))
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    engine = {k: v for k, v in vars(args).items() if k in names}
    return args, engine


def connector_config(args: argparse.Namespace, engine: dict[str, Any]) -> dict[str, Any]:
    """``kv_connector_extra_config`` for the warm engine: the serving instances' (when their
    ``--kv-transfer-config`` is given), with our URL, namespace and TTL."""
    served = engine.pop("kv_transfer_config", None)
    extra = dict(getattr(served, "kv_connector_extra_config", None) or {})
    extra["url"] = args.url or extra.get("url") or os.environ.get("KVSTORE_URL")
    extra["namespace"] = args.namespace or extra.get("namespace", "vllm")
    extra["ttl_s"] = args.ttl or None
    extra.pop("mode", None)
    return extra


# ---------------------------------------------------------------------------------------- warm
def warm(args: argparse.Namespace, engine_kwargs: dict[str, Any], out: Console) -> int:
    from connector.warm.engine import WarmEngine

    if not args.model:
        raise NothingDone("--model is required (the serving instances' model)")
    config = connector_config(args, engine_kwargs)
    if not config["url"]:
        raise NothingDone("--url (or $KVSTORE_URL) is required: the serving instances' store URL")
    style = PromptStyle(
        args.prefix,
        args.suffix,
        chat=bool(args.chat or args.chat_template or args.system),
        chat_template=_read_template(args.chat_template),
        system=args.system,
    )
    docs = read_documents(args.documents, args.text_field, args.id_field)
    if not docs:
        raise NothingDone("no documents given")
    store = _connect(config, args.ttl)  # Redis down or refusing: fail before any work
    try:
        eng = WarmEngine(engine_kwargs, config)
        rows = _plan(eng, store, docs, style)
        _run(eng, store, rows, args.in_flight, args.json)
    finally:
        store.close()
    layout = eng.layout
    _print(out, rows, args.json, layout.namespace, layout.fingerprints, layout.model_id, "warm")
    return 1 if any(r.status in ("failed", "partial") for r in rows) else 0


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise NothingDone(f"cannot read --chat-template {path}: {exc}") from None


def _connect(config: dict[str, Any], ttl: float) -> LookupBuffer:
    tls = {k: config[k] for k in ("tls_ca_file", "tls_cert_file", "tls_key_file") if k in config}
    try:
        store = LookupBuffer.from_url(
            config["url"],
            namespace=config["namespace"],
            fingerprint=_ANY_FINGERPRINT,
            ttl_s=ttl or None,
            **tls,
        )
    except KVStoreError as exc:
        raise NothingDone(f"{exc}\nNothing was warmed.") from None
    try:
        store.check_access(OPERATIONS)
    except KVStoreError as exc:
        store.close()
        raise NothingDone(f"{exc}\nNothing was warmed.") from None
    return store


def _plan(
    eng: WarmEngine, store: LookupBuffer, docs: list[Document], style: PromptStyle
) -> list[Row]:
    """Tokenize every document as requests will, and sort out those with nothing to prefill:
    unreadable, too long, shorter than a block, or already in the pool (one round trip for
    all; their TTL is renewed and their record rewritten)."""
    layout = eng.layout
    try:
        # blocks are named in the namespace's generation, as the engine's connector names them:
        # a block saved before a reset is never loaded again
        generation = store.read_generation()
    except KVStoreError as exc:
        raise NothingDone(f"{exc}\nNothing was warmed.") from None
    rows = []
    for doc in docs:
        row = Row(doc.name, "failed", doc=doc, message=doc.error or "")
        rows.append(row)
        if doc.text is None:
            continue
        try:
            text, special = render(style, doc.text, eng.tokenizer)
        except Exception as exc:  # a chat template that fails on this text: say which and why
            row.message = f"cannot render it: {exc}"
            continue
        tokens = list(eng.tokenizer.encode(text, add_special_tokens=special))
        row.tokens = len(tokens)
        if len(tokens) >= eng.max_model_len:
            row.message = (
                f"{len(tokens)} tokens: longer than the model's context ({eng.max_model_len}); "
                "split it, or serve and warm with a larger --max-model-len"
            )
            continue
        row.chain = [block_name(h, generation) for h in chain_hashes(tokens, layout.block_size)]
        row.blocks = len(row.chain)
        if not row.chain:
            row.status = "short"
            row.message = f"shorter than one block ({layout.block_size} tokens): nothing to store"
            continue
        row.status, row.token_ids = "todo", tokens
    todo = [r for r in rows if r.status == "todo"]
    try:
        present = store.longest_prefixes([r.chain for r in todo], layout.fingerprints)
    except KVStoreError as exc:
        raise NothingDone(f"{exc}\nNothing was warmed.") from None
    for row, n in zip(todo, present, strict=True):
        row.present = n
        if n == row.blocks:
            row.status = "present"
            row.message = "TTL renewed"
            store.renew(row.chain, layout.fingerprints)
            _record(store, eng.layout, row)
    return rows


def _record(store: LookupBuffer, layout: StoreLayout, row: Row) -> None:
    assert row.doc is not None
    try:
        _save_record(store, layout, row)
    except RecordTooLargeError as exc:
        row.message = f"{row.message}; {exc}" if row.message else str(exc)


def _save_record(store: LookupBuffer, layout: StoreLayout, row: Row) -> None:
    assert row.doc is not None
    save_record(
        store,
        DocumentRecord(
            name=row.document,
            tokens=row.tokens,
            # generation-free names (its id is its last block's): --check names them in the
            # generation current then
            chain=[in_generation(h, 0) for h in row.chain],
            fingerprints=layout.fingerprints,
            model=layout.model_id,
            text_hash=row.doc.text_hash,
        ),
    )


def _run(
    eng: WarmEngine, store: LookupBuffer, rows: list[Row], in_flight: int, quiet: bool
) -> None:
    """Prefill the documents not in the pool, wait for their writes to be confirmed, and
    prefill again those whose writes came up short."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    todo = [r for r in rows if r.status == "todo"]
    total_tokens = sum(r.tokens for r in todo)
    progress = Progress(
        TextColumn("warming"),
        BarColumn(),
        TextColumn("{task.fields[docs]}"),
        TextColumn("{task.completed:,.0f}/{task.total:,.0f} tokens"),
        TextColumn("{task.fields[bytes]}"),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        disable=quiet or not sys.stderr.isatty(),
        transient=False,
    )
    t0 = time.perf_counter()
    done_docs, done_bytes = 0, 0
    with progress:
        task = progress.add_task("", total=total_tokens, docs="", bytes="", rate="")

        def update() -> None:
            elapsed = max(time.perf_counter() - t0, 1e-9)
            progress.update(
                task,
                docs=f"{done_docs}/{len(todo)} docs",
                bytes=human_size(done_bytes),
                rate=f"{progress.tasks[0].completed / elapsed:,.0f} tok/s",
            )

        def confirm(waiting: list[Row]) -> None:
            """Settle the rows whose writes are confirmed; count the finished ones."""
            nonlocal done_docs, done_bytes
            for row in _confirmed(store, eng.layout, waiting):
                if row.status != "todo":  # (else: to be prefilled again)
                    done_docs += 1
                    done_bytes += row.bytes
                    progress.advance(task, row.tokens)
            update()

        update()
        for attempt in range(RETRIES + 1):
            batch = [r for r in todo if r.status == "todo"]
            if not batch:
                break
            by_key = {str(i): r for i, r in enumerate(batch)}
            waiting: list[Row] = []
            now = time.perf_counter()
            for r in batch:
                r.started = r.started or now
                r.attempts = attempt + 1
            prompts = [(k, r.token_ids) for k, r in by_key.items()]
            try:
                for finished in eng.prefill(prompts, in_flight):
                    for f in finished:
                        row = by_key[f.key]
                        row.finished = time.perf_counter()
                        if f.error:
                            row.status, row.message = "failed", f.error
                            continue
                        row.handoff = (f.params or {}).get("handoff")
                        waiting.append(row)
                    confirm(waiting)
                while waiting:
                    confirm(waiting)
                    time.sleep(0.02)
            except KVStoreError as exc:
                for r in batch:
                    if r.status == "todo":
                        r.status, r.message = "failed", f"not confirmed: {exc}"
            except Exception as exc:  # the engine died: say what became of every document
                for r in batch:
                    if r.status == "todo":
                        r.status = "failed"
                        r.message = f"the engine failed: {type(exc).__name__}: {exc}"
                raise
        for r in todo:
            if r.status == "todo":  # still short after the retries
                r.status = "partial"


def _confirmed(store: LookupBuffer, layout: StoreLayout, waiting: list[Row]) -> list[Row]:
    """The rows whose writes the connector has confirmed (its commit record), or that waited
    too long; each removed from ``waiting`` and settled."""
    settled = []
    for row in list(waiting):
        committed: int | None = 0
        if row.handoff is not None:  # None: the engine saved nothing for it
            state = store.read_handoff(row.handoff, row.chain, layout.fingerprints)
            committed = state.committed
            if committed is None and time.perf_counter() - row.finished < COMMIT_WAIT_S:
                continue  # still being written
            # a count never confirmed (the record expired, say): what is there is what counts
            committed = state.present if committed is None else min(committed, state.present)
        waiting.remove(row)
        settled.append(row)
        _settle(store, layout, row, committed or 0)
    return settled


def _settle(store: LookupBuffer, layout: StoreLayout, row: Row, committed: int) -> None:
    row.seconds = time.perf_counter() - row.started
    if committed < row.blocks and row.attempts <= RETRIES:
        row.message = f"{row.blocks - committed} blocks not written; prefilling again"
        return  # stays "todo"; counted when it settles
    new = row.chain[row.present : committed]
    row.stored = len(new)
    if new:
        row.bytes = sum(i.size for i in store.block_info(new, layout.fingerprints))
    if committed < row.blocks:
        row.message = (
            f"{row.blocks - committed} of {row.blocks} blocks could not be written (Redis full, "
            "or saves shed: see the warnings above, raise max_inflight_bytes or lower --in-flight)"
        )
        row.status = "partial"
    else:
        row.status, row.message = "stored", ""
    if row.present:
        store.renew(row.chain[: row.present], layout.fingerprints)  # the part already there
    _record(store, layout, row)


# ---------------------------------------------------------------------------------------- check
def check(args: argparse.Namespace, out: Console) -> int:
    """Per warmed document (all in the namespace, or those named), the share of its blocks in
    the pool now, the usable prefix and the TTL left. No model is loaded."""
    url = args.url or os.environ.get("KVSTORE_URL")
    if not url:
        raise NothingDone("--url (or $KVSTORE_URL) is required")
    namespace = args.namespace or "vllm"
    try:
        store = LookupBuffer.from_url(url, namespace=namespace, fingerprint=_ANY_FINGERPRINT)
    except KVStoreError as exc:
        raise NothingDone(f"{exc}") from None
    try:
        records, problems = read_records(store, args.model)
        rows = []
        wanted = read_documents(args.documents, args.text_field, args.id_field)
        wanted_by_name = {d.name: d for d in wanted}
        by_name: dict[str, list[DocumentRecord]] = {}
        for rec in records:
            by_name.setdefault(rec.name, []).append(rec)
        for doc in wanted:
            if doc.name not in by_name:
                rows.append(Row(doc.name, "not warmed", message=doc.error or ""))
        names = [d.name for d in wanted] if wanted else list(by_name)
        checked = [rec for name in names for rec in by_name.get(name, [])]
        # a record names its blocks in the generation it was warmed in; after a reset only
        # the current generation's blocks load
        generation = store.read_generation()
        found = presences(
            store,
            [([in_generation(h, generation) for h in r.chain], r.fingerprints) for r in checked],
        )
        for rec, now in zip(checked, found, strict=True):
            name = rec.name
            row = Row(
                name,
                "complete" if now.present == now.blocks else "incomplete",
                tokens=rec.tokens,
                blocks=now.blocks,
                present=now.present,
                bytes=now.bytes,
                ttl_s=round(now.ttl_s, 1) if now.ttl_s is not None else None,
                message=f"usable prefix {now.usable}/{now.blocks} blocks",
            )
            given = wanted_by_name.get(name)
            if given is not None and given.text is not None and given.text_hash != rec.text_hash:
                row.message += "; the file changed since it was warmed: warm it again"
            rows.append(row)
    except KVStoreError as exc:
        raise NothingDone(f"{exc}") from None
    finally:
        store.close()
    if not rows and not args.json:
        out.print(shown(f"no warmed documents in namespace {namespace!r}"))
    _print(out, rows, args.json, namespace, None, args.model, "check", problems)
    if problems:  # (on stderr too: a script reading the JSON may not look for them)
        print(
            f"connector.warm: {len(problems)} malformed document record(s) skipped",
            file=sys.stderr,
        )
    complete = rows and all(r.status == "complete" for r in rows)
    return 0 if complete and not problems else 1


# ---------------------------------------------------------------------------------------- output
def _print(
    out: Console,
    rows: list[Row],
    as_json: bool,
    namespace: str,
    fingerprints: list[str] | None,
    model: str | None,
    mode: str,
    problems: Sequence[RecordProblem] = (),
) -> None:
    totals = {
        "documents": len(rows),
        "tokens": sum(r.tokens for r in rows),
        "blocks": sum(r.blocks for r in rows),
        "present": sum(r.present for r in rows),
        "stored": sum(r.stored for r in rows),
        "bytes": sum(r.bytes for r in rows),
        "seconds": round(sum(r.seconds for r in rows), 3),
    }
    if as_json:
        doc = {
            "mode": mode,
            "namespace": namespace,
            "model": model,
            "fingerprints": fingerprints,
            "documents": [r.report() for r in rows],
            "totals": totals,
        }
        if mode == "check":
            doc["malformed_records"] = [dataclasses.asdict(p) for p in problems]
        print(json.dumps(doc, indent=2))
        return
    if rows:
        out.print(_table(rows, totals, namespace, model, mode))
    if problems:
        out.print(_problems(problems))


def _table(
    rows: list[Row], totals: dict[str, Any], namespace: str, model: str | None, mode: str
) -> Table:
    from rich.table import Table

    table = Table(title=shown(f"namespace {namespace}" + (f", model {model}" if model else "")))
    table.add_column("document", overflow="fold")
    cols = (
        ["tokens", "blocks", "stored", "present", "bytes", "seconds"]
        if mode == "warm"
        else ["tokens", "blocks", "present", "share", "bytes", "TTL left"]
    )
    for c in cols:
        table.add_column(c, justify="right")
    table.add_column("status")
    for r in rows:
        values = {
            "tokens": f"{r.tokens:,}",
            "blocks": f"{r.blocks:,}",
            "stored": f"{r.stored:,}",
            "present": f"{r.present:,}",
            "share": f"{100 * r.present / r.blocks:.0f}%" if r.blocks else "0%",
            "bytes": human_size(r.bytes),
            "seconds": f"{r.seconds:.2f}",
            "TTL left": "none" if r.ttl_s is None else f"{r.ttl_s:,.0f} s",
        }
        status = r.status + (f": {r.message}" if r.message else "")
        # a name is cut at shown's default (--json keeps it whole); a status may quote an error
        table.add_row(shown(r.document), *[values[c] for c in cols], shown(status, limit=2000))
    if mode == "warm":
        table.add_section()
        table.add_row(
            "total",
            f"{totals['tokens']:,}",
            f"{totals['blocks']:,}",
            f"{totals['stored']:,}",
            f"{totals['present']:,}",
            human_size(totals["bytes"]),
            "",
            "",
        )
    return table


def _problems(problems: Sequence[RecordProblem]) -> Text:
    """The malformed records, each key and what is wrong with it, as text a terminal shows as
    it is (a planted key may hold any bytes)."""
    from rich.text import Text

    lines = [
        shown(
            f"{len(problems)} malformed document record(s) skipped: not written by "
            "connector.warm, or damaged. Delete them (redis-cli UNLINK KEY) and warm those "
            "documents again.",
            limit=None,
            style="red",
        )
    ]
    for p in problems[:SHOWN_PROBLEMS]:
        lines.append(Text.assemble("  ", shown(p.key), ": ", shown(p.problem)))
    if len(problems) > SHOWN_PROBLEMS:
        lines.append(Text(f"  ... and {len(problems) - SHOWN_PROBLEMS} more (--json lists all)"))
    return Text("\n").join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console

    args, engine = parse_args(list(sys.argv[1:] if argv is None else argv))
    # piped: 120 columns (rich's 80 would fold every row), or $COLUMNS
    wide = sys.stdout.isatty() or "COLUMNS" in os.environ
    out = Console(emoji=False, highlight=False, width=None if wide else 120)
    try:
        return check(args, out) if args.check else warm(args, engine, out)
    except NothingDone as exc:
        print(f"connector.warm: {exc}", file=sys.stderr)
        return 2
