"""Which Host headers and web pages (Origin) the server answers (cullama/server/sites.py), in this process;
tests/test_server.py and tests/test_server_engine.py send them to a real socket."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")

from cullama.server.sites import Sites, host_name  # noqa: E402


@pytest.mark.parametrize("header, name", [
    ("localhost", "localhost"), ("LocalHost:8000", "localhost"), ("127.0.0.1:8000", "127.0.0.1"),
    ("[::1]:8000", "::1"), ("[::1]", "::1"), ("::1", "::1"), ("example.com.", "example.com"),
    ("example.com.:80", "example.com"),
])
def test_a_host_header_is_its_name_without_the_port(header, name):
    assert host_name(header) == name


LOOPBACK = ["localhost", "localhost:8000", "LOCALHOST", "app.localhost:8000", "127.0.0.1", "127.0.0.1:8000",
            "127.1.2.3", "[::1]:8000", "[::ffff:127.0.0.1]:8000"]
FOREIGN = ["evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.evil.example", "10.0.0.5",
           "[fe80::1]", "0.0.0.0:8000", "2130706433"]  # a decimal IPv4 is a name to Python: refused


@pytest.mark.parametrize("host", LOOPBACK)
def test_loopback_names_and_addresses_are_always_answered(host):
    assert Sites().host_allowed(host)


@pytest.mark.parametrize("host", FOREIGN)
def test_other_names_and_addresses_are_refused_by_a_loopback_server(host):
    # Listening on 127.0.0.1, as by default: what DNS rebinding sends (a name the attacker points at us) fails.
    assert not Sites(["127.0.0.1"]).host_allowed(host)


def test_the_listening_address_the_names_allowed_and_any_address_on_all_interfaces():
    lan = Sites(["192.168.1.5", "myserver.lan"])
    assert lan.host_allowed("192.168.1.5:8000") and lan.host_allowed("MyServer.lan:8000")
    assert not lan.host_allowed("192.168.1.6") and not lan.host_allowed("other.lan")
    everywhere = Sites(["0.0.0.0"])  # reached by any of the machine's addresses; a name still needs allowing
    assert everywhere.host_allowed("10.1.2.3:8000") and everywhere.host_allowed("[2001:db8::1]")
    assert not everywhere.host_allowed("evil.example")
    assert Sites(["::", "box.example"]).host_allowed("box.example") and Sites(["*"]).host_allowed("evil.example")


def test_a_page_of_another_origin_needs_allowing_its_own_origin_does_not():
    sites = Sites(["127.0.0.1"], ["http://localhost:3000", "https://chat.example/"])
    assert sites.origin_allowed("http://127.0.0.1:8000", "127.0.0.1:8000")  # the server's own origin
    assert sites.origin_allowed("http://localhost:3000", "127.0.0.1:8000")
    assert sites.origin_allowed("https://CHAT.example", "127.0.0.1:8000")
    for page in ("http://evil.example", "http://localhost:3001", "https://127.0.0.1:8000", "null", ""):
        assert not sites.origin_allowed(page, "127.0.0.1:8000"), page
    assert not sites.origin_allowed("http://", "")  # no Host: no origin of its own
    assert Sites(origins=["*"]).origin_allowed("http://evil.example", "127.0.0.1:8000")
