"""What keeps `tiller serve` safe by default: the bind address, the bearer key, the body size
limit and the folder weight updates may be read from."""

from __future__ import annotations

import hmac
import ipaddress
import json
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tiller.serve.protocol import APIError

OPEN_PATHS = frozenset({"/health"})  # answered without the api key (load balancers probe it)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach: localhost, 127.0.0.0/8, ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def resolve_below(root: Path, requested: str) -> Path:
    """The real path of `requested` (relative to `root`, or absolute), or APIError 403 when it,
    or a `*.safetensors` file in it, lies outside `root` once `..` and symlinks are resolved."""
    target = (root / requested).resolve()  # an absolute `requested` replaces root here
    if target != root and root not in target.parents:
        raise APIError(403, f"model_path {requested!r} is outside --weights-root {str(root)!r}")
    if not target.is_dir():
        raise APIError(400, f"model_path {requested!r} is not a folder below --weights-root")
    for f in target.glob("*.safetensors"):
        real = f.resolve()
        if root not in real.parents:
            raise APIError(403, f"{f.name} in {requested!r} links outside --weights-root")
    return target


class Guard:
    """ASGI middleware: 401 without `Authorization: Bearer <api_key>` (when a key is set) on
    every path but /health, and 413 for bodies over `max_body_bytes` (declared or streamed)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):  # constant time
                await _reply(send, APIError(401, "missing or wrong api key: send the header "
                                                 "'Authorization: Bearer <key>'"))
                return
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            await _reply(send, _too_large(self.max_body_bytes))
            return

        received = 0

        async def counted_receive() -> Message:
            # a chunked body that grows past the limit: the app's APIError handler answers 413
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise _too_large(self.max_body_bytes)
            return message

        await self.app(scope, counted_receive, send)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body over {limit} bytes (--max-body-bytes)")


async def _reply(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
