"""No cross-site use of the server: the Host a request names and the web page (Origin) it comes from.

Any web page the user opens can send requests to any address, loopback included. Two things keep such a
page from driving the model or reading its answers:

- Host: a page on `evil.example` whose name the attacker re-points at 127.0.0.1 (DNS rebinding) is the
  same origin as the server in the browser's eyes, so it may read every answer; but its requests still
  name `evil.example` in their Host header. A request is served only when its Host is a loopback name or
  address (`localhost`, `*.localhost`, 127.0.0.0/8, ::1), the address the server listens on (any address
  when it listens on all of them: an IP address cannot be re-pointed), or a name given with
  --allowed-hosts ("*": any). A request without a Host header (HTTP/1.0; browsers always send one) passes.
- Origin: a browser names the page a request comes from. A request from a page of another origin than
  the server's own is refused (403) unless --allowed-origins lists it ("*": any page), and then the
  answer carries `Access-Control-Allow-Origin` and CORS preflights (OPTIONS) are answered, so that a
  browser front-end meant to use the server can. Requests from programs send no Origin and pass.
  (The bodies a page may send without a preflight are never JSON: app.check_content_type's 415.)

Both are checked before anything else, the API key included, and each refusal is OpenAI's error object.
"""

from __future__ import annotations

import ipaddress
from typing import Callable, Iterable

from fastapi.responses import JSONResponse, Response

from .protocol import ApiError

METHODS = "GET, HEAD, POST, OPTIONS"  # what the routes answer (a preflight's Access-Control-Allow-Methods)
PREFLIGHT_MAX_AGE_S = "600"


def host_name(header: str) -> str:
    """The name or address of a Host header, without its port: `[::1]:8000` -> `::1`, `Example.COM.` ->
    `example.com`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    return header.rsplit(":", 1)[0].rstrip(".") if header.count(":") == 1 else header.rstrip(".")


def address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`name` as an IP address (an IPv4-mapped IPv6 address as its IPv4 one), None where it is a name."""
    try:
        ip = ipaddress.ip_address(name.split("%")[0])
    except ValueError:
        return None
    return (ip.ipv4_mapped or ip) if ip.version == 6 else ip


def said(value: str) -> str:
    """A header's value, shown short and escaped in a message."""
    return repr(value[:100])[1:-1] + ("..." if len(value) > 100 else "")


class Sites:
    """Which Hosts and Origins the server answers (see the module docstring). `hosts`: the names and
    addresses it listens on and those allowed besides ("*": any); `origins`: the web pages allowed to use
    it, as `scheme://host[:port]` ("*": any)."""

    def __init__(self, hosts: Iterable[str] = (), origins: Iterable[str] = ()):
        hosts, origins = list(hosts), list(origins)
        self.any_host, self.any_origin = "*" in hosts, "*" in origins
        self.names, self.addresses, self.any_address = {"localhost"}, set(), False
        for host in hosts:
            ip = address(host_name(host))
            if ip is None:
                self.names.add(host_name(host))
            elif ip.is_unspecified:  # 0.0.0.0 or ::: reached by any of the machine's addresses
                self.any_address = True
            else:
                self.addresses.add(ip)
        self.origins = {origin.strip().rstrip("/").lower() for origin in origins if origin != "*"}

    def host_allowed(self, host: str) -> bool:
        name = host_name(host)
        ip = address(name)
        if ip is None:
            return self.any_host or name in self.names or name.endswith(".localhost")
        return self.any_host or ip.is_loopback or self.any_address or ip in self.addresses

    def origin_allowed(self, origin: str, host: str) -> bool:
        """A page of the server's own origin, or one allowed."""
        origin = origin.strip().lower()
        return self.any_origin or origin in self.origins or (bool(host) and origin == f"http://{host.lower()}")


class CrossSite:
    """ASGI middleware: refuses a request whose Host or Origin is not allowed, answers CORS preflights from
    allowed origins, and marks their answers readable by them. `refused(path, status)` hears each refusal."""

    def __init__(self, app, sites: Sites, refused: Callable[[str, int], None]):
        self.app, self.sites, self.refused = app, sites, refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        hosts = [v.decode("latin-1") for k, v in scope["headers"] if k == b"host"]
        origins = [v.decode("latin-1") for k, v in scope["headers"] if k == b"origin"]
        error = self.check(hosts, origins)
        if error is not None:
            self.refused(scope["path"], error.status)
            response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
            return await response(scope, receive, send)
        if not origins:
            return await self.app(scope, receive, send)
        allow = [(b"access-control-allow-origin", origins[0].encode("latin-1")), (b"vary", b"Origin")]
        headers = dict(scope["headers"])
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            asked = headers.get(b"access-control-request-headers", b"").decode("latin-1")
            preflight = Response(status_code=204, headers={
                "Access-Control-Allow-Methods": METHODS, "Access-Control-Allow-Headers": asked,
                "Access-Control-Max-Age": PREFLIGHT_MAX_AGE_S})
            preflight.raw_headers += allow
            return await preflight(scope, receive, send)

        async def send_allowed(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *allow]}
            await send(message)

        await self.app(scope, receive, send_allowed)

    def check(self, hosts: list[str], origins: list[str]) -> ApiError | None:
        for host in hosts:
            if not self.sites.host_allowed(host):
                name = said(host_name(host))
                return ApiError(400, f"the Host header names `{name}`, which is not a name this server answers "
                                     f"to (loopback names and the address it listens on): start it with "
                                     f"--allowed-hosts {name} to allow it", code="invalid_host")
        if len(origins) > 1:
            return ApiError(403, "a request may come from one web page: it has more than one Origin header",
                            code="origin_not_allowed")
        if origins and not self.sites.origin_allowed(origins[0], hosts[0] if hosts else ""):
            page = said(origins[0])
            return ApiError(403, f"requests from the web page at `{page}` are refused: start the server with "
                                 f"--allowed-origins {page} to let that page use it", code="origin_not_allowed")
        return None
