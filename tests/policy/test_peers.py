"""policy.peers: a token travels in clear text on loopback only; what a peer's URL may be."""

from __future__ import annotations

import pytest

from torpor.policy import peers


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_addresses_and_localhost_are_loopback(host: str) -> None:
    assert peers.loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.2", "node2", "localhost.example.com", ""])
def test_any_other_address_or_name_is_not(host: str) -> None:
    assert not peers.loopback(host)


def test_listening_beyond_loopback_needs_tls() -> None:
    assert peers.listen_problem("127.0.0.1", 7788, tls=False) is None
    assert peers.listen_problem("0.0.0.0", 7788, tls=True) is None
    problem = peers.listen_problem("0.0.0.0", 7788, tls=False)
    assert problem is not None and "clear text" in problem and "--tls-cert" in problem


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("node2:7788", "give the peer agent's address"),
        ("ftp://node2:7788", "give the peer agent's address"),
        ("https://", "give the peer agent's address"),
        ("https://user:pw@node2:7788", "never in the URL"),
        ("https://node2:7788/v1/health", "no path"),
        ("https://node2:7788?x=1", "no path"),
        ("https://node2:99999", "port"),
        ("https://node2:0", "port"),
        ("http://node2:7788", "clear text"),
        ("http://10.0.0.2:7788", "clear text"),
    ],
)
def test_a_url_that_cannot_be_a_peer_s_says_why(url: str, says: str) -> None:
    problem = peers.url_problem(url)
    assert problem is not None and says in problem


@pytest.mark.parametrize(
    "url", ["https://node2:7788", "https://node2:7788/", "https://[fd00::2]:7788", "http://127.0.0.1:7788"]
)
def test_https_anywhere_and_http_on_loopback_are_peers_urls(url: str) -> None:
    assert peers.url_problem(url) is None


def test_a_peer_s_url_is_kept_without_its_trailing_slash() -> None:
    assert peers.base_url("https://node2:7788/") == "https://node2:7788"


DIGITS = "ab" * 32


@pytest.mark.parametrize(
    "given",
    [
        DIGITS,
        DIGITS.upper(),
        ":".join([DIGITS[i : i + 2] for i in range(0, 64, 2)]).upper(),
        f"sha256:{DIGITS}",
        f"SHA256 Fingerprint={':'.join([DIGITS[i : i + 2] for i in range(0, 64, 2)]).upper()}",
        f"  {DIGITS}\n",
    ],
)
def test_a_fingerprint_is_read_as_people_and_openssl_write_it(given: str) -> None:
    assert peers.fingerprint(given) == f"sha256:{DIGITS}"


@pytest.mark.parametrize("given", ["", "ab:cd", DIGITS[:-1], DIGITS + "0", "g" * 64, f"sha1:{DIGITS}"])
def test_anything_else_is_no_fingerprint(given: str) -> None:
    assert peers.fingerprint(given) is None


def test_a_peer_of_another_architecture_or_criu_differs_and_unknowns_do_not() -> None:
    here = {"arch": "x86_64", "criu": "4.2"}
    assert peers.differences(here, {"arch": "x86_64", "criu": "4.2", "kernel": "6.1"}) == []
    assert peers.differences(here, {"arch": "aarch64", "criu": "4.1"}) == [
        "arch aarch64, here x86_64",
        "CRIU 4.1, here 4.2",
    ]
    assert peers.differences(here, {"arch": "x86_64", "criu": None}) == []
    assert peers.differences({"arch": "x86_64", "criu": None}, {"arch": "x86_64", "criu": "4.2"}) == []
