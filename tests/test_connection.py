from __future__ import annotations

import pytest

from kvstore import InvalidURLError, LookupBuffer, parse_url, redact_url
from kvstore.connection import make_client


@pytest.mark.parametrize(
    ("url", "transport", "tls", "host", "port", "db"),
    [
        ("redis://127.0.0.1:6379/0", "tcp", False, "127.0.0.1", 6379, 0),
        ("redis://cache", "tcp", False, "cache", 6379, 0),
        ("redis://user:pw@h:7000/3", "tcp", False, "h", 7000, 3),
        ("rediss://h:6380/1", "tcp", True, "h", 6380, 1),
        ("valkey://h:6379/2", "tcp", False, "h", 6379, 2),
        ("valkeys://h/0", "tcp", True, "h", 6379, 0),
        ("unix:///run/redis.sock?db=4", "unix", False, "", 6379, 4),
    ],
)
def test_accepted_urls(url: str, transport: str, tls: bool, host: str, port: int, db: int) -> None:
    a = parse_url(url)
    assert (a.transport, a.tls, a.host, a.port, a.db) == (transport, tls, host, port, db)


@pytest.mark.parametrize(
    "url",
    [
        "",
        "http://h:6379",
        "redis://:6379",
        "redis://h:notaport",
        "redis://h:6379/notadb",
        "unix://",
        "redis://h:6379/0?bogus=1",
        "redis://h:99999",
    ],
)
def test_invalid_urls_raise_a_typed_error_that_says_what_is_expected(url: str) -> None:
    with pytest.raises(InvalidURLError) as info:
        parse_url(url)
    assert "redis://" in str(info.value)


def test_password_never_appears_in_errors_reprs_or_safe_url() -> None:
    secret = "s3cr3t-pw"
    a = parse_url(f"redis://alice:{secret}@h:1/0")
    assert a.password == secret and a.username == "alice"
    assert secret not in repr(a) and secret not in a.safe_url and "***" in a.safe_url
    assert secret not in redact_url(f"valkeys://alice:{secret}@h:1/0")
    with pytest.raises(InvalidURLError) as info:
        parse_url(f"redis://alice:{secret}@h:bad/0")
    assert secret not in str(info.value)
    buf = LookupBuffer(make_client(a), safe_url=a.safe_url)
    assert secret not in repr(buf)


def test_tls_options_from_query() -> None:
    a = parse_url("rediss://h:6380/0?tls_ca_file=/ca.pem&tls_verify=false")
    kwargs = make_client(a).connection_pool.connection_kwargs
    assert kwargs["ssl_ca_certs"] == "/ca.pem" and kwargs["ssl_cert_reqs"] == "none"


def test_credentials_are_percent_decoded_and_aliases_map_to_redis_py_schemes() -> None:
    a = parse_url("valkeys://us%40er:p%40ss%3Aword@h:6390/5")
    assert (a.username, a.password, a.tls, a.port, a.db) == ("us@er", "p@ss:word", True, 6390, 5)
    assert "p%40ss" not in a.safe_url and "p@ss" not in a.safe_url
    b = parse_url("valkey+unix:///tmp/v.sock?db=2")
    assert (b.transport, b.path, b.db) == ("unix", "/tmp/v.sock", 2)
