"""Which Host headers and web pages (Origin) the server answers (cullama/server/sites.py), in this process;
tests/server/test_server.py and tests/server/test_server_engine.py send them to a real socket."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")

from cullama.server.sites import CrossSite, Sites, host_name  # noqa: E402


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


def test_an_ip_address_with_a_zone_is_that_address():
    assert Sites().host_allowed("[::1%lo]:8000") and Sites(["0.0.0.0"]).host_allowed("[fe80::1%eth0]")


# -- the middleware, called in this process -------------------------------------------------------------
class Recorder:
    """The app behind the middleware: records what reached it and answers 200 with one header of its own."""

    def __init__(self):
        self.scopes = []

    async def __call__(self, scope, receive, send):
        self.scopes.append(scope)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-app", b"1")]})
        await send({"type": "http.response.body", "body": b"ok"})


def call(headers, method="POST", sites=None, scope_type="http"):
    """(status, {header: value}, body, scopes the app saw, refusals heard) of one request through CrossSite."""
    app, heard, sent = Recorder(), [], []
    middleware = CrossSite(app, sites or Sites(["127.0.0.1"], ["http://ui.example"]),
                           lambda path, status: heard.append((path, status)))
    scope = {"type": scope_type, "method": method, "path": "/v1/completions", "headers":
             [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    start = next((m for m in sent if m["type"] == "http.response.start"), {"status": None, "headers": []})
    answer = {k.decode("latin-1"): v.decode("latin-1") for k, v in start["headers"]}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], answer, body, app.scopes, heard


def test_the_middleware_refuses_a_foreign_host_with_its_name_short_and_escaped():
    status, _, body, scopes, heard = call([("Host", "evil.example:8000")])
    error = json.loads(body)["error"]
    assert (status, scopes, heard, error["code"]) == (400, [], [("/v1/completions", 400)], "invalid_host")
    assert "`evil.example`" in error["message"] and "--allowed-hosts evil.example " in error["message"]
    long = "a" * 99 + "\x07" + "b" * 50  # 150 characters: the first 100 shown, escaped, then "..."
    message = json.loads(call([("Host", long)])[2])["error"]["message"]
    assert "`" + "a" * 99 + "\\x07...`" in message
    exactly = "c" * 100  # 100 characters: shown whole; 101: cut
    assert f"`{exactly}`" in json.loads(call([("Host", exactly)])[2])["error"]["message"]
    assert f"`{exactly}...`" in json.loads(call([("Host", exactly + "d")])[2])["error"]["message"]


def test_the_middleware_checks_every_host_and_refuses_two_origins():
    assert call([("Host", "127.0.0.1"), ("Host", "evil.example")])[0] == 400
    status, _, body, scopes, heard = call([("Host", "127.0.0.1"), ("Origin", "http://ui.example"),
                                           ("Origin", "http://ui.example")])
    assert (status, json.loads(body)["error"]["code"], scopes, heard) == \
        (403, "origin_not_allowed", [], [("/v1/completions", 403)])


def test_the_middleware_refuses_a_foreign_page_and_names_it():
    status, _, body, scopes, _ = call([("Host", "127.0.0.1:8000"), ("Origin", "http://evil.example")])
    error = json.loads(body)["error"]
    assert (status, error["code"], scopes) == (403, "origin_not_allowed", [])
    assert "`http://evil.example`" in error["message"] and "--allowed-origins http://evil.example " in error["message"]
    # The server's own origin is the first Host's.
    assert call([("Host", "127.0.0.1:8000"), ("Origin", "http://127.0.0.1:8000")])[0] == 200
    assert call([("Host", "127.0.0.1:8000"), ("Host", "localhost:8000"), ("Origin", "http://localhost:8000")])[0] == 403
    assert call([("Origin", "http://127.0.0.1:8000")])[0] == 403  # no Host: no origin of its own


def test_a_program_passes_untouched_and_an_allowed_page_may_read_the_answer():
    status, headers, body, scopes, heard = call([("Host", "127.0.0.1:8000")])
    assert (status, body, len(scopes), heard) == (200, b"ok", 1, [])
    assert "access-control-allow-origin" not in headers and headers["x-app"] == "1"
    assert call([])[0] == 200  # no Host (HTTP/1.0), no Origin
    status, headers, body, scopes, _ = call([("Host", "127.0.0.1"), ("Origin", "http://UI.example")])
    assert (status, body, len(scopes)) == (200, b"ok", 1)
    assert headers["access-control-allow-origin"] == "http://UI.example" and headers["vary"] == "Origin"
    assert headers["x-app"] == "1"


def test_an_allowed_pages_preflight_is_answered_here_and_other_options_requests_reach_the_app():
    asked = [("Host", "127.0.0.1"), ("Origin", "http://ui.example"), ("Access-Control-Request-Method", "POST"),
             ("Access-Control-Request-Headers", "content-type, authorization")]
    status, headers, _, scopes, _ = call(asked, "OPTIONS")
    assert (status, scopes) == (204, [])
    assert headers["access-control-allow-methods"] == "GET, HEAD, POST, OPTIONS"
    assert headers["access-control-allow-headers"] == "content-type, authorization"
    assert headers["access-control-max-age"] == "600" and headers["access-control-allow-origin"] == "http://ui.example"
    assert call(asked[:3], "OPTIONS")[1]["access-control-allow-headers"] == ""
    status, headers, _, scopes, _ = call(asked[:2], "OPTIONS")  # no Access-Control-Request-Method: no preflight
    assert (status, len(scopes), headers["access-control-allow-origin"]) == (200, 1, "http://ui.example")
    assert call(asked, "POST")[0] == 200  # the same headers on a POST: the app answers


def test_what_is_not_http_is_not_checked():
    assert call([("Host", "evil.example")], scope_type="lifespan")[3][0]["type"] == "lifespan"
