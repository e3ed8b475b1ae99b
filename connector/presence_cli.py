"""``vllm-redis-presence`` (or ``python -m connector.presence_cli``): which leading blocks of a
prompt are stored, and how many a connector would load, as a router would ask.

    vllm-redis-presence --url redis://127.0.0.1:6379/0 --layout LAYOUT.json \\
        (--tokens 1,2,3 | --tokens-file F) [--cache-salt S] [--lora-name N --lora-path P] [--json]

The layout is the file the connector's scheduler writes (``$REDIS_KV_CONNECTOR_LAYOUT_FILE``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvstore import InvalidArgumentError, KVStoreError
from kvstore.values.keys import DEFAULT_KEY_PREFIX


def token_ids(tokens: str | None, tokens_file: str | None) -> list[int]:
    """The prompt's token ids, from ``--tokens 1,2,3`` or a JSON list in a file ('-': stdin):
    the proxy's rule (integers in [0, 2**63), not true or false); anything else, a file that
    cannot be read included, is an ``InvalidArgumentError`` (they were tracebacks)."""
    from connector.presence import valid_token_ids

    if tokens is not None:
        text = "[" + tokens + "]"
    elif tokens_file == "-":
        text = sys.stdin.read()
    else:
        assert tokens_file is not None
        try:
            with open(tokens_file) as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError(f"--tokens-file: {exc}") from None
    try:
        ids = json.loads(text)
    except (ValueError, RecursionError):
        ids = None
    if not valid_token_ids(ids):
        raise InvalidArgumentError(
            "token ids must be a list of integers from 0 to 2**63-1, e.g. --tokens 1,2,3"
        )
    return ids


def present(
    url: str, prefix: str, layout_file: str, ids: list[int], salt: str = ""
) -> dict[str, Any]:
    """``connector.presence.prompt_presence`` of ``ids`` under the layout in the file."""
    from connector.presence import StoredLayout, prompt_presence
    from kvstore import LookupBuffer

    layout = StoredLayout.from_file(layout_file)
    with LookupBuffer.from_url(
        url, namespace=layout.namespace, key_prefix=prefix, check=False
    ) as buf:
        return prompt_presence(buf, layout, ids, salt).as_dict()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="vllm-redis-presence",
        # the docstring's first paragraph (its first line ended mid-sentence)
        description=" ".join(__doc__.split("\n\n")[0].split()) if __doc__ else None,
    )
    ap.add_argument(
        "--url",
        default=os.environ.get("KVSTORE_URL", "redis://127.0.0.1:6379/0"),
        help="store URL (default: $KVSTORE_URL or redis://127.0.0.1:6379/0)",
    )
    ap.add_argument("--prefix", default=DEFAULT_KEY_PREFIX, help="key prefix (default: kv)")
    ap.add_argument(
        "--layout",
        required=True,
        help="the JSON file the connector writes ($REDIS_KV_CONNECTOR_LAYOUT_FILE)",
    )
    tokens = ap.add_mutually_exclusive_group(required=True)
    tokens.add_argument("--tokens", help="the prompt's token ids, comma-separated")
    tokens.add_argument("--tokens-file", help="a JSON list of token ids ('-': standard input)")
    ap.add_argument("--cache-salt", help="the request's cache_salt, if it has one")
    ap.add_argument("--lora-name", help="the request's LoRA adapter (as vLLM names it)")
    ap.add_argument("--lora-path", default="", help="... and its path, as the server has it")
    ap.add_argument("--json", action="store_true", help="machine-readable output")
    args = ap.parse_args(argv)
    from connector.presence import prompt_salt

    try:
        salt = prompt_salt(
            lora_name=args.lora_name, lora_path=args.lora_path, cache_salt=args.cache_salt
        )
        found = present(
            args.url, args.prefix, args.layout, token_ids(args.tokens, args.tokens_file), salt
        )
    except KVStoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(found, default=str))
        return 0
    blocks = found["blocks"]
    print(
        f"{sum(blocks)} of {len(blocks)} full blocks stored; a connector would load "
        f"{found['loadable_blocks']} leading blocks ({found['loadable_tokens']} tokens), "
        f"generation {found['generation']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
