from __future__ import annotations

import logging
import ssl
import subprocess
import uuid
from pathlib import Path
from urllib.parse import unquote

import pytest
import redis

from kvstore import InvalidArgumentError, InvalidURLError, LookupBuffer, parse_url, redact_url
from kvstore.net.connection import make_client


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


# ---------------------------------------------------------------- passwords in odd URLs
# Each password has two distinctive pieces: neither may show, whichever piece the parsers would
# take for a host, port, path or query (a raw "/", "?" or "#" ends urlsplit's authority).
_PASSWORDS = [
    "pwA1/pwB2",
    "pwA1#pwB2",
    "pwA1?pwB2",
    "pwA1@pwB2",
    "pwA1%2FpwB2",
    "pwA1&pwB2",
    "6379/pwB2",  # the head looks like a port
    "pwA1:pwB2",
]
_FORMS = {  # scheme -> the URL around "{creds}" ("user:password") and "{pw}" (a bare password)
    **{s: "{s}://{creds}@h:6379/0" for s in ("redis", "rediss", "valkey", "valkeys")},
    **{s: "{s}://{creds}@/run/redis.sock?db=1" for s in ("unix", "redis+unix", "valkey+unix")},
    **{
        f"{n}{t}-sentinel": "{s}://{creds}@h1:26379,h2:26380/mymaster/0"
        for n in ("redis", "valkey")
        for t in ("", "s")
    },
    **{
        f"{n}{t}-cluster": "{s}://{creds}@h1:7000,h2:7001"
        for n in ("redis", "valkey")
        for t in ("", "s")
    },
}
_QUERY_FORMS = [
    "redis://h:6379/0?password={pw}",
    "rediss://h:6379/0?tls_verify=true&password={pw}&tls_ca_file=/ca.pem",
    "unix:///run/redis.sock?password={pw}&db=2",
    "redis-sentinel://h1:1/svc?password={pw}",
    "redis-cluster://h1:1?tls_ca_file=/ca.pem&password={pw}",
]


def _odd_urls() -> list[tuple[str, str]]:
    out = []
    for pw in _PASSWORDS:
        for scheme, form in _FORMS.items():
            for creds in (f"alice:{pw}", f":{pw}"):
                out.append((form.format(s=scheme, creds=creds), pw))
        out += [(form.format(pw=pw), pw) for form in _QUERY_FORMS]
    return out


@pytest.mark.parametrize(("url", "password"), _odd_urls())
def test_no_piece_of_an_odd_password_is_ever_shown(url: str, password: str) -> None:
    """Issue: redact_url split the URL with urlsplit, which ends the authority at a raw "/",
    "?" or "#": it found no password and printed the URL as it was."""
    pieces = {password, unquote(password), "pwA1", "pwB2"} - {"6379"}
    shown = [redact_url(url), redact_url(f"  {url}")]
    try:
        a = parse_url(url)
    except InvalidURLError as exc:
        shown.append(str(exc))
    else:
        shown += [repr(a), str(a), a.safe_url]
        # accepted: the parser took exactly what the redaction masked
        assert a.password is not None and "***" in a.safe_url
    for text in shown:
        for piece in pieces:
            assert piece not in text, (url, text)


@pytest.mark.parametrize(
    ("url", "password"),
    [
        ("redis://alice:pwA1@pwB2@h:6379/0", "pwA1@pwB2"),
        ("valkeys://alice:pwA1%2FpwB2@h:6379/0", "pwA1/pwB2"),
        ("unix://:pwA1%23pwB2@/run/redis.sock?db=1", "pwA1#pwB2"),
        ("redis-sentinel://alice:pwA1%3FpwB2@h1:1/svc", "pwA1?pwB2"),
        ("redis-cluster://alice:pwA1@pwB2@h1:1,h2:2", "pwA1@pwB2"),
        ("redis://h:6379/0?password=pwA1%26pwB2", "pwA1&pwB2"),
    ],
)
def test_percent_encoded_and_at_sign_passwords_are_parsed_whole(url: str, password: str) -> None:
    a = parse_url(url)
    assert a.password == password and a.host in ("h", "h1", "")
    assert "pwA1" not in a.safe_url and "pwB2" not in a.safe_url


@pytest.mark.parametrize(
    "url",
    ["redis://alice:pwA1/pwB2@h:1/0", "redis-cluster://alice:pwA1?pwB2@h1:1", "redis://h/0?x=a@b"],
)
def test_an_at_sign_after_a_slash_question_mark_or_hash_is_refused_saying_to_percent_encode(
    url: str,
) -> None:
    with pytest.raises(InvalidURLError, match="percent-encode"):
        parse_url(url)


def test_a_url_without_a_scheme_never_names_what_may_be_a_password() -> None:
    for url in ("pwA1pwB2@h:6379", "alice:pwA1pwB2@h:6379"):
        with pytest.raises(InvalidURLError) as info:
            parse_url(url)
        assert "pwA1pwB2" not in str(info.value) and "pwA1pwB2" not in redact_url(url)


# ---------------------------------------------------------------- TLS settings
def test_tls_verify_false_warns_once_per_url_naming_it_and_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = f"h-{uuid.uuid4().hex[:8]}"
    url = f"rediss://alice:pwA1@{host}:6380/0?tls_verify=false"
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        make_client(parse_url(url))
        make_client(parse_url(url))  # LookupBuffer.from_url makes two clients of one URL
        make_client(parse_url(f"rediss://{host}:6380/0"), tls_verify=False)
    warned = [r for r in caplog.records if "does not verify" in r.getMessage()]
    assert len(warned) == 2  # one per URL
    text = warned[0].getMessage()
    assert f"rediss://alice:***@{host}:6380/0" in text and "pwA1" not in text
    assert "tls_ca_file=" in text and "any certificate" in text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore"):
        make_client(parse_url(f"rediss://{host}:6381/0?tls_ca_file=/ca.pem"))
    assert not caplog.records


@pytest.mark.parametrize("verify", ["true", "false"])
def test_sentinels_and_the_master_get_the_same_tls_settings(
    verify: str, tls_files: dict[str, str]
) -> None:
    """Issue: the connections to the sentinels got the CA, certificate and verify mode, but
    not the host name check (left to redis-py's default)."""
    cert, key = tls_files["cert"], tls_files["key"]  # (a pair that loads)
    url = (
        "rediss-sentinel://alice:pw@s1:26379,s2:26380/mymaster?tls_ca_file=/ca.pem"
        f"&tls_cert_file={cert}&tls_key_file={key}&tls_verify={verify}"
    )
    client = make_client(parse_url(url))  # connects lazily: nothing is reached here
    on = verify == "true"
    want = {
        "ssl_ca_certs": "/ca.pem",
        "ssl_certfile": cert,
        "ssl_keyfile": key,
        "ssl_cert_reqs": "required" if on else "none",
        "ssl_check_hostname": on,
    }
    pool = client.connection_pool
    manager = pool.sentinel_manager
    assert issubclass(pool.connection_class, redis.SSLConnection)  # the master's
    assert {k: pool.connection_kwargs[k] for k in want} == want
    assert {k: manager.sentinel_kwargs.get(k) for k in want} == want
    assert manager.sentinel_kwargs.get("ssl") is True
    for sentinel in manager.sentinels:  # the clients of the sentinels themselves
        spool = sentinel.connection_pool
        assert issubclass(spool.connection_class, redis.SSLConnection)
        assert {k: spool.connection_kwargs[k] for k in want} == want
        conn = spool.make_connection()  # what redis-py builds its TLS context from
        assert (conn.cert_reqs != ssl.CERT_NONE, conn.check_hostname) == (on, on)
        assert (conn.ca_certs, conn.certfile, conn.keyfile) == ("/ca.pem", cert, key)


def test_an_encrypted_client_key_is_refused_at_once_not_prompted_for(
    tls_files: dict[str, str], tmp_path: Path
) -> None:
    """Found in review: a key with a passphrase made each connect ask a terminal for it and
    wait for ever (without one: 'Invalid argument', four prompts later)."""
    encrypted = tmp_path / "encrypted.key"
    encrypt = ["openssl", "pkey", "-in", tls_files["key"], "-aes256", "-passout", "pass:x"]
    subprocess.run([*encrypt, "-out", str(encrypted)], check=True, capture_output=True)
    url = f"rediss://127.0.0.1:1/0?tls_cert_file={tls_files['cert']}&tls_key_file={encrypted}"
    with pytest.raises(InvalidArgumentError, match="without a passphrase"):
        make_client(parse_url(url))


def test_a_client_key_goes_with_its_certificate(tls_files: dict[str, str], tmp_path: Path) -> None:
    """One file holding both is a certificate file alone; a key alone failed each connect with
    redis-py's TypeError (a review's)."""
    both = tmp_path / "both.pem"
    both.write_text(Path(tls_files["cert"]).read_text() + Path(tls_files["key"]).read_text())
    make_client(parse_url(f"rediss://127.0.0.1:1/0?tls_cert_file={both}"))
    with pytest.raises(InvalidArgumentError, match="needs tls_cert_file"):
        make_client(parse_url(f"rediss://127.0.0.1:1/0?tls_key_file={both}"))


@pytest.mark.parametrize(
    "url",
    [
        "redis://h:6379/0?tls_ca_file=/ca.pem",
        "redis://h:6379/0?tls_verify=true",
        "redis-cluster://h1:1,h2:2?tls_ca_file=/ca.pem",
        "redis-sentinel://s1:26379/svc?tls_cert_file=/c.pem",
        "rediss://h:6379/0?tls_verify=off",  # (taken for yes: say which words count)
    ],
)
def test_tls_options_on_a_plain_url_are_refused_not_ignored(url: str) -> None:
    """Found in review: TLS options on redis:// were ignored and the connection, its password
    with it, went in clear."""
    with pytest.raises(InvalidURLError, match=r"TLS scheme|tls_verify must be"):
        parse_url(url)


def test_tls_files_given_for_a_plain_url_are_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="in clear"):
        make_client(parse_url("redis://h:6379/0"), tls_ca_file="/ca.pem")


@pytest.mark.parametrize(
    "url",
    [
        "redis://pwA1pwB2@h:6379/0",  # a lone user name: Lettuce's password-only form
        "redis-sentinel://pwA1pwB2@h1:1/svc",
        "redis-cluster://pwA1pwB2@h1:1",
        "redis://h:6379/0?pass%77ord=pwA1pwB2",  # redis-py decodes parameter names
        "redis://h:6379/0?%50ASSWORD=pwA1pwB2&db=1",
        "redis://h:6379/0?token=pwA1pwB2",  # not a parameter of ours: refused, value unshown
        "redis://alice:pw@h:6379/0#pwA1pwB2",
    ],
)
def test_what_may_be_a_secret_is_never_shown_in_any_form(url: str) -> None:
    """Found by a review: each of these printed pwA1pwB2 in every CLI message, log line and
    repr (``safe_url`` masked only a ``user:password`` and a literal ``password=``)."""
    shown = [redact_url(url)]
    try:
        a = parse_url(url)
    except InvalidURLError as exc:
        shown.append(str(exc))
    else:
        shown += [repr(a), a.safe_url]
    assert not any("pwA1pwB2" in text for text in shown), shown


def test_the_values_of_known_options_and_a_user_with_a_password_are_still_shown() -> None:
    a = parse_url("rediss://alice:pw@h:6379/2?tls_ca_file=/ca.pem&tls_verify=false")
    assert a.safe_url == "rediss://alice:***@h:6379/2?tls_ca_file=/ca.pem&tls_verify=false"


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), 1e300, 3601, True, "5"])
@pytest.mark.parametrize("name", ["socket_timeout_s", "control_timeout_s", "connect_timeout_s"])
def test_a_timeout_out_of_range_is_refused_naming_it(name: str, bad: object) -> None:
    """A review: 1e300 made redis-py's settimeout raise OverflowError at start-up, NaN a
    ValueError; both untyped."""
    with pytest.raises(InvalidArgumentError, match=name):
        LookupBuffer.from_url("redis://127.0.0.1:1/0", check=False, **{name: bad})
