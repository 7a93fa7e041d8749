"""What keeps tiller's HTTP servers safe by default: the Host and Content-Type checks, the
bearer keys and the body size limit (`Guard`, shared by `tiller serve`, the agent gateway and
`tiller view`), and the folder weight updates may be read from (`resolve_below`, and
`opened_below`, which opens a checked file without following a link swapped in since)."""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tiller.errors import ConfigError
from tiller.serve.protocol import APIError

OPEN_PATHS = frozenset({"/health"})  # answered without the api key (load balancers probe it)
META_MAX_BYTES = 8 << 20  # tiller_version.json: versions, names, numels and checksums


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach: localhost, 127.0.0.0/8, ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def resolve_below(root: Path, requested: str) -> tuple[Path, dict[str, Path]]:
    """The real path of the folder `requested` (relative to `root`, or absolute) and the real
    paths of its `*.safetensors` files by their names in it, to be opened from exactly these
    paths (`opened_below`). APIError 403 when the folder or a file lies outside `root` once
    `..` and symlinks are resolved; 400 when the path cannot be resolved (a NUL byte, a name
    too long, a symlink loop), is not a folder, or a file is not a regular file (a FIFO would
    hang the load)."""
    shown = requested if len(requested) <= 100 else requested[:100] + "..."
    try:
        target = (root / requested).resolve()  # an absolute `requested` replaces root here
        if target != root and root not in target.parents:
            raise APIError(403, f"model_path {requested!r} is outside --weights-root "
                                f"{str(root)!r}")
        if not stat.S_ISDIR(target.stat().st_mode):
            raise APIError(400, f"model_path {requested!r} is not a folder below --weights-root")
        files = {}
        for f in sorted(target.glob("*.safetensors")):
            real = f.resolve(strict=True)
            if root not in real.parents:
                raise APIError(403, f"{f.name} in {requested!r} links outside --weights-root")
            if not stat.S_ISREG(real.stat().st_mode):
                raise APIError(400, f"{f.name} in {requested!r} is not a regular file")
            files[f.name] = real
    except FileNotFoundError as e:
        raise APIError(400, f"model_path {requested!r} is not a folder below --weights-root "
                            f"({e.strerror})") from e
    except (OSError, ValueError, RuntimeError) as e:  # NUL byte, ENAMETOOLONG, symlink loop
        raise APIError(400, f"model_path {shown!r} cannot be resolved: "
                            f"{type(e).__name__}: {e}"[:300]) from e
    return target, files


def open_below(root: Path, real: Path) -> int:
    """A read-only descriptor of the regular file at `real`, a resolved path inside `root`,
    opened one folder at a time from `root` without following a link at any step (and
    without blocking on a FIFO): a link swapped in anywhere below `root` after `real` was
    checked fails the open instead of redirecting it. APIError 403 when `real` is not inside
    `root` (a `..` or `.` among its parts included: it must be its own normal form, so the
    walk never climbs); 400 when it cannot be opened so, is not a regular file, or has other
    hard links (one in `root` could name any file of the server's user elsewhere)."""
    if root not in real.parents or str(real) != os.path.normpath(real):
        raise APIError(403, f"{real.name} links outside --weights-root {str(root)!r}")
    *folders, name = real.relative_to(root).parts
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    at = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in folders:
            below = os.open(part, flags | os.O_DIRECTORY, dir_fd=at)
            os.close(at)
            at = below
        fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=at)
    except OSError as e:  # ELOOP or ENOTDIR: a link was swapped in; or the file went away
        raise APIError(400, f"{name} cannot be opened below --weights-root: "
                            f"{type(e).__name__}: {e}"[:300]) from e
    finally:
        os.close(at)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        raise APIError(400, f"{name} is not a regular file" if not stat.S_ISREG(st.st_mode)
                       else f"{name} has {st.st_nlink} hard links; a weight file must have one")
    return fd


@contextmanager
def opened_below(root: Path, real: Path) -> Iterator[Path]:
    """A path naming the file `open_below` opened (its descriptor's entry in /proc/self/fd,
    or /dev/fd), for a reader that opens files by name (safetensors): opening it opens the
    file that was checked, whatever has since been moved or linked at `real`."""
    fd = open_below(root, real)
    try:
        yield Path("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd", str(fd))
    finally:
        os.close(fd)


def read_below(root: Path, path: Path, max_bytes: int = META_MAX_BYTES) -> bytes | None:
    """The bytes of the file at `path` under the rules of `resolve_below`: None when there is
    none; APIError 403 when it resolves outside `root`, 400 when it cannot be resolved, is not
    a regular file or has over `max_bytes`. It is opened as `open_below` opens (no link
    followed after the check, no wait on a FIFO) and checked on the open file."""
    if not os.path.lexists(path):
        return None
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as e:  # a symlink loop, a dangling link
        raise APIError(400, f"{path.name} cannot be read: {type(e).__name__}: {e}"[:300]
                       ) from e
    if root not in real.parents:
        raise APIError(403, f"{path.name} links outside --weights-root {str(root)!r}")
    with os.fdopen(open_below(root, real), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise APIError(400, f"{path.name} has {size} bytes, over the limit of {max_bytes}")
        return f.read(max_bytes + 1)[:max_bytes]


MIN_KEY_CHARS = 16
WILDCARDS = frozenset({"0.0.0.0", "::", ""})  # bind addresses meaning every interface


def check_api_keys(keys: tuple[str, ...]) -> None:
    """ConfigError (one line) for a key under MIN_KEY_CHARS characters, with whitespace or
    non-ASCII characters (it must fit an Authorization header as it is), or given twice."""
    for i, key in enumerate(keys):
        if len(key) < MIN_KEY_CHARS:
            raise ConfigError(f"api key {i + 1} has {len(key)} characters; use at least "
                              f"{MIN_KEY_CHARS} (e.g. python -c 'import secrets; "
                              f"print(secrets.token_urlsafe(24))')")
        if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
            raise ConfigError(f"api key {i + 1} has whitespace or non-ASCII characters; use "
                              "printable ASCII only")
    if len(set(keys)) != len(keys):
        raise ConfigError("the same api key is given twice; give each client its own key")


def check_exposure(host: str, api_keys: tuple[str, ...]) -> None:
    """ConfigError (one line) for bad keys (`check_api_keys`) or for a bind address other
    machines can reach without a key."""
    check_api_keys(api_keys)
    if not api_keys and not is_loopback(host):
        raise ConfigError(f"--host {host} is reachable from other machines: pass --api-key "
                          "(or set TILLER_API_KEY), or bind 127.0.0.1")


@dataclass(frozen=True)
class Hosts:
    """The `Host` headers a server answers: loopback names (`localhost`, 127.0.0.0/8, ::1),
    the address it is bound to (any IP literal when that is a wildcard: an IP literal cannot
    be rebound by DNS), and the names in `extra` (`tiller serve --allowed-host`). Anything
    else is a DNS-rebinding page or a misrouted request."""

    bound: str = "127.0.0.1"
    extra: tuple[str, ...] = ()
    hint: str = ""  # ends the 421's message: how to add a name

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        if host in {h.lower().rstrip(".") for h in (self.bound, *self.extra)}:
            return True
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:  # a name
            return host == "localhost"
        return ip.is_loopback or self.bound in WILDCARDS


def host_name(header: bytes) -> str | None:
    """The host part of a Host header ("example.com:80" -> "example.com", "[::1]:80" ->
    "::1"); None when it is not one."""
    try:
        text = header.decode("ascii")
    except UnicodeDecodeError:
        return None
    if text.startswith("["):
        end = text.find("]")
        rest = text[end + 1:]
        if end < 0 or rest and not (rest[0] == ":" and rest[1:].isdigit()):
            return None
        return text[1:end]
    name, _, port = text.partition(":")
    if not name or (port and not port.isdigit()) or ":" in port:
        return None
    return name


class Guard:
    """ASGI middleware shared by tiller's HTTP servers (`tiller serve`, the agent gateway,
    `tiller view`), refusing in this order:

    - 400 without exactly one `Host` header; 421 for a `Host` that `hosts` does not allow
      (DNS rebinding: a web page whose name now points at this machine);
    - 401 without `Authorization: Bearer <key>` for one of `api_keys` (when any are set) on
      every path but /health; the key's index is left in `scope["state"]["client"]`;
    - 415 for a request other than GET or HEAD whose `Content-Type` is not
      `application/json` (a web page can send text/plain, form and multipart bodies to any
      server without asking; a JSON body needs the server's consent, which is never given);
    - 413 for bodies over `max_body_bytes` (declared or streamed).

    A refusal closes the connection (`Connection: close`): one kept alive after it would
    hold a place under the connection cap for a client that was not served.

    `refused(scope, error)`, when given, is told of each refusal (the gateway counts them)."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, hosts: Hosts,
                 api_keys: tuple[str, ...] = (),
                 refused: Callable[[Scope, APIError], None] | None = None):
        self.app, self.max_body_bytes, self.hosts = app, max_body_bytes, hosts
        self.expected = [f"Bearer {k}".encode() for k in api_keys]
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error, client = self._check(scope)
        if error is not None:
            if self.refused is not None:
                self.refused(scope, error)
            await reply(send, error, close=True)
            return
        scope.setdefault("state", {})["client"] = client
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

    def _check(self, scope: Scope) -> tuple[APIError | None, int | None]:
        """(the refusal, or None; the index of the api key given, None without keys)."""
        hosts = [v for k, v in scope["headers"] if k == b"host"]
        if len(hosts) != 1:
            return APIError(400, f"a request needs exactly one Host header, got {len(hosts)}"
                            ), None
        name = host_name(hosts[0])
        if name is None or not self.hosts.allows(name):
            shown = hosts[0][:100].decode("ascii", "replace")
            return APIError(421, f"Host {shown!r} is not served here: use this server's "
                                 f"address or a loopback name{self.hosts.hint}"), None
        headers = dict(scope["headers"])
        client = None
        if self.expected:
            given = headers.get(b"authorization", b"")
            matches = [hmac.compare_digest(given, e) for e in self.expected]  # constant time
            client = matches.index(True) if any(matches) else None
            if client is None and scope["path"] not in OPEN_PATHS:
                return APIError(401, "missing or wrong api key: send the header "
                                     "'Authorization: Bearer <key>'"), None
        if scope["method"] not in ("GET", "HEAD"):
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media != b"application/json":
                shown = media[:100].decode("ascii", "replace") or "none"
                return APIError(415, f"{scope['method']} needs 'Content-Type: "
                                     f"application/json' (got {shown})"), None
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
            return _too_large(self.max_body_bytes), None
        return None, client


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body over {limit} bytes (--max-body-bytes)")


async def reply(send: Send, error: APIError, *, close: bool = False) -> None:
    """Answer `error` as JSON; with `close`, close the connection after it."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": error.status,
                "headers": headers + [(b"connection", b"close")] * close})
    await send({"type": "http.response.body", "body": body})
