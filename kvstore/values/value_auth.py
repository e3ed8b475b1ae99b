"""Authenticated values: a namespace's secret keys a MAC over every value's header and payload,
so a writer without the secret -- anyone with the namespace's ACL password, a leaked consumer
credential, a process on the Redis host -- cannot make a reader load its KV.

The MAC is keyed BLAKE3 (``blake3`` from PyPI, the reference implementation's binding), 128-bit
tags. Chosen by measurement (``scripts/bench_paths.py --mac``): on the 2-core AMD EPYC test VM it
hashed 9-10 GB/s against 2.1 GB/s for HMAC-SHA256 and 1.4 GB/s for keyed BLAKE2b, both from
hashlib; that is a few percent of a load at the 1-2 GB/s a rank reads from Redis, where the
others would cost half of it.

The keys are derived from the secret and the namespace (BLAKE3's key derivation), so a value
copied from one namespace to another under the same secret does not verify there either;
from an epoch too, where one is given (the weights' version): a value signed in another epoch
never verifies, whatever the namespace's generation counter says -- a counter is Redis data, so
a writer with raw access could set it back (or delete it) and put back values it recorded,
and an instance started afterwards would name and load them; its configured epoch it cannot
change. And
one key per use -- a header, a payload, a tensor -- so the tag of bytes a writer was made to
store as a payload (a caller's tensors) is never a valid tag of a header.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
from pathlib import Path
from typing import Any

from kvstore.errors import InvalidArgumentError

logger = logging.getLogger("kvstore")

MAC_HEX = 32  # hex digits of a tag: 128 bits
# the reasons (``CorruptValueError.reason``) of values that fail the MAC check: a tag that does
# not verify, none where the reader has a secret, one where it has none
UNAUTHENTICATED = ("forged", "unsigned", "no-secret")
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096  # a secret file is a few dozen bytes; a larger one is a wrong path
_CONTEXT = "vllm-redis-kvstore 2026-11-27 value MAC v2"
# what a tag authenticates: each its own key
HEADER, PAYLOAD, TENSOR = "header", "payload", "tensor"


def _blake3() -> Any:
    try:
        import blake3
    except ImportError:  # a core dependency: only a broken install gets here
        raise InvalidArgumentError(
            "a namespace secret needs the blake3 package: pip install blake3"
        ) from None
    return blake3.blake3


class ValueKey:
    """One namespace's MAC key. Its repr and str never show the secret or the key."""

    __slots__ = ("_blake3", "_keys")

    def __init__(self, secret: bytes, namespace: str, epoch: str = "") -> None:
        check_epoch(epoch)
        if not isinstance(secret, (bytes, bytearray)):
            raise InvalidArgumentError("a namespace secret must be bytes")
        if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
            raise InvalidArgumentError(
                f"a namespace secret must hold {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, "
                f"got {len(secret)}: make one with `openssl rand -base64 32`"
            )
        self._blake3 = _blake3()
        material = bytes(secret) + b"\x00" + namespace.encode()
        if epoch:  # (none: the key values were always signed with)
            material += b"\x00epoch\x00" + epoch.encode()
        self._keys = {
            use: self._blake3(material, derive_key_context=f"{_CONTEXT} {use}").digest()
            for use in (HEADER, PAYLOAD, TENSOR)
        }

    def __repr__(self) -> str:
        return "ValueKey(<secret>)"

    __str__ = __repr__

    def tag(self, use: str, data: Any) -> str:
        """The hex tag of one buffer, as a ``use`` (:data:`HEADER`, :data:`PAYLOAD`,
        :data:`TENSOR`)."""
        return str(self._blake3(data, key=self._keys[use]).hexdigest(MAC_HEX // 2))

    def hasher(self, use: str) -> Any:
        """A streaming MAC: ``update`` the buffers, then ``hexdigest(MAC_HEX // 2)``."""
        return self._blake3(key=self._keys[use])

    def verify(self, use: str, data: Any, tag: str) -> bool:
        """Whether ``tag`` is the tag of ``data`` as a ``use`` (constant time)."""
        return hmac.compare_digest(self.tag(use, data), tag)


MAX_EPOCH_CHARS = 128


def check_epoch(epoch: object) -> None:
    """An epoch (``ValueKey``) is printable ASCII of at most ``MAX_EPOCH_CHARS``: a weights
    version, a checkpoint step, a date. Raises :class:`InvalidArgumentError` saying so."""
    if not isinstance(epoch, str):
        raise InvalidArgumentError(f"an epoch must be a string, got {type(epoch).__name__}")
    if len(epoch) > MAX_EPOCH_CHARS or not all(" " < c <= "~" for c in epoch):
        raise InvalidArgumentError(
            f"an epoch is up to {MAX_EPOCH_CHARS} printable ASCII characters without spaces "
            "(a weights version or checkpoint step, e.g. 'step-1200')"
        )


def load_secret(*, secret_file: str | None = None, secret_env: str | None = None) -> bytes | None:
    """The namespace secret from a file or an environment variable (never from a URL or the
    config itself, which vLLM logs); None when neither is set. Surrounding whitespace -- a
    file's trailing newline -- is not part of it. Raises :class:`InvalidArgumentError` naming
    the source (never the secret) when it cannot be read or is too short."""
    for name, given in (("secret_file", secret_file), ("secret_env", secret_env)):
        if given is not None and not isinstance(given, str):
            raise InvalidArgumentError(f"{name} must be a string, got {type(given).__name__}")
    if secret_file and secret_env:
        raise InvalidArgumentError("give secret_file or secret_env, not both")
    if secret_file:
        path = Path(secret_file)
        try:
            with path.open("rb") as f:
                mode = os.fstat(f.fileno()).st_mode
                raw = f.read(MAX_SECRET_BYTES + 1)
        except OSError as exc:
            raise InvalidArgumentError(
                f"cannot read the namespace secret file {secret_file}: {exc.strerror}"
            ) from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(
                "kvstore: the namespace secret file %s can be read by other users (mode %o): "
                "chmod 600 it",
                secret_file,
                stat.S_IMODE(mode),
            )
        where = f"file {secret_file}"
    elif secret_env:
        text = os.environ.get(secret_env)
        if text is None:
            raise InvalidArgumentError(
                f"the namespace secret's environment variable {secret_env} is not set"
            )
        raw, where = text.encode(), f"environment variable {secret_env}"
    else:
        return None
    secret = raw.strip()
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise InvalidArgumentError(
            f"the namespace secret in {where} must hold {MIN_SECRET_BYTES} to "
            f"{MAX_SECRET_BYTES} bytes: make one with `openssl rand -base64 32`"
        )
    return secret
