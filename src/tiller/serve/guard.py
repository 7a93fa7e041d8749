"""What keeps `tiller serve` safe by default: the bind address, the bearer key, the body size
limit and the folder weight updates may be read from."""

from __future__ import annotations

import hmac
import ipaddress
import json
import stat
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


def resolve_below(root: Path, requested: str) -> tuple[Path, list[Path]]:
    """The real path of the folder `requested` (relative to `root`, or absolute) and the real
    paths of its `*.safetensors` files, to be loaded from exactly these paths. APIError 403 when
    the folder or a file lies outside `root` once `..` and symlinks are resolved; 400 when the
    path cannot be resolved (a NUL byte, a name too long, a symlink loop), is not a folder, or
    a file is not a regular file (a FIFO would hang the load)."""
    shown = requested if len(requested) <= 100 else requested[:100] + "..."
    try:
        target = (root / requested).resolve()  # an absolute `requested` replaces root here
        if target != root and root not in target.parents:
            raise APIError(403, f"model_path {requested!r} is outside --weights-root "
                                f"{str(root)!r}")
        if not stat.S_ISDIR(target.stat().st_mode):
            raise APIError(400, f"model_path {requested!r} is not a folder below --weights-root")
        files = []
        for f in sorted(target.glob("*.safetensors")):
            real = f.resolve(strict=True)
            if root not in real.parents:
                raise APIError(403, f"{f.name} in {requested!r} links outside --weights-root")
            if not stat.S_ISREG(real.stat().st_mode):
                raise APIError(400, f"{f.name} in {requested!r} is not a regular file")
            files.append(real)
    except FileNotFoundError as e:
        raise APIError(400, f"model_path {requested!r} is not a folder below --weights-root "
                            f"({e.strerror})") from e
    except (OSError, ValueError, RuntimeError) as e:  # NUL byte, ENAMETOOLONG, symlink loop
        raise APIError(400, f"model_path {shown!r} cannot be resolved: "
                            f"{type(e).__name__}: {e}"[:300]) from e
    return target, files


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
                await reply(send, APIError(401, "missing or wrong api key: send the header "
                                                 "'Authorization: Bearer <key>'"))
                return
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            await reply(send, _too_large(self.max_body_bytes))
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


async def reply(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    await send({"type": "http.response.start", "status": error.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
