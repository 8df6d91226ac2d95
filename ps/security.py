"""Who may talk to a run's shards: the shared token, TLS files, and where shards may bind.

Its own module, free of side effects: ps.server forces JAX_PLATFORMS=cpu when imported,
and the launcher importing it for these checks passed that on to GPU workers.

A run launched in one command (ps.driver) has a token by default: without one, any local
process is a trusted peer on both ports. The launcher makes a random one per run
and hands it to its shards and workers in their environment (readable only by this user,
like a 0600 file), unless JAXDIST_PS_TOKEN gives one; `--ps-insecure`, or
JAXDIST_PS_TOKEN set to "", runs without, with a notice.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import time

from jaxdist.errors import UsageError

TOKEN_ENV = "JAXDIST_PS_TOKEN"
MIN_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def address_problem(bind: str) -> str | None:
    """Why `bind` is no address at all (an IP address or a host name), or None. Checked
    before the token rule, which only applies to a real address beyond loopback."""
    try:
        ipaddress.ip_address(bind)
        return None
    except ValueError:
        pass
    labels = bind.rstrip(".").split(".")
    # a host name's last label is never all digits: 999.1.1.1 is a bad IPv4 address
    if (0 < len(bind) <= 253 and all(_LABEL.fullmatch(x) for x in labels)
            and not labels[-1].isdigit()):
        return None
    return (f"--ps-bind {bind[:80]!r} is not a valid address: give an IPv4 or IPv6 address "
            f"of this host (127.0.0.1 by default) or a host name")


def security_problems(bind: str, token: str | None, cert: str, key: str) -> str | None:
    """Why these security options are unusable, or None."""
    bad = address_problem(bind)
    if bad:
        return bad
    if not is_loopback(bind) and not token:
        return (f"--ps-bind {bind} exposes the shard servers beyond this host; set a shared "
                f"token in {TOKEN_ENV} (at least {MIN_TOKEN_CHARS} characters) on every "
                f"server and worker")
    if token is not None and token != "" and len(token.strip()) < MIN_TOKEN_CHARS:
        # whitespace does not count: a token of 16 spaces is as guessable as an empty one
        return (f"{TOKEN_ENV} must be at least {MIN_TOKEN_CHARS} characters, not counting "
                f"whitespace")
    if bool(cert) != bool(key):
        return "--ps-tls-cert and --ps-tls-key go together: give both or neither"
    for flag, path in (("--ps-tls-cert", cert), ("--ps-tls-key", key)):
        if path and not os.path.isfile(path):
            return f"{flag} {path}: no such file"
    return None


def run_token(environ, insecure: bool) -> tuple[str, str | None]:
    """(the token a launched run's processes share, "" for none; a notice or None).
    Raises UsageError when --ps-insecure contradicts a given token."""
    given = environ.get(TOKEN_ENV)
    if insecure and given:
        raise UsageError(f"--ps-insecure runs without a token, but {TOKEN_ENV} gives one: "
                         f"drop one of them")
    if insecure or given == "":
        why = "--ps-insecure" if insecure else f"{TOKEN_ENV} is set and empty"
        return "", (f"ps: no token ({why}): any local process can push to and pull from "
                    f"this run's shards")
    if given:
        return given, None
    return secrets.token_urlsafe(32), None


# -- mutual authentication ----------------------------------------------------------------
#
# Neither side ever sends the token. A shard proves it holds it first, over the client's
# fresh nonce; only then does the client answer over the shard's fresh nonce. Each proof is
# an HMAC-SHA256 keyed by the token over a label naming its direction (a shard's proof
# reflected back at it is not a worker's proof), both nonces, and the channel it was made
# on: the port (gRPC or data) the client dialled and the shard's index. A process that
# listens on a port a shard once held, and relays the challenge to the shard's real port,
# gets a proof for that other port, which the client refuses.

NONCE_BYTES = 32
PROOF_BYTES = 32
SESSION_KEY = "x-jaxdist-session"  # gRPC metadata: a call's session ticket (see below)
SESSION_S = 3600.0                 # a gRPC session ticket's life; then a new handshake
HANDSHAKE_S = 5.0                  # a client's wait for the shard's half: a listener that
                                   # never answers is left after it, not the call's deadline
_SHARD_LABEL = b"jaxdist-ps shard->worker v1"
_CLIENT_LABEL = b"jaxdist-ps worker->shard v1"


class HandshakeError(Exception):
    """The peer did not prove it holds the run's token (or sent no handshake at all)."""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def channel_binding(channel: str, shard: int, port: int) -> bytes:
    """What a proof is bound to: `channel` ("grpc" or "data"), the shard's index, and the
    port the client dialled (the shard's own listening port)."""
    return f"{channel}|shard {int(shard)}|port {int(port)}".encode()


def _mac(token: str, label: bytes, *parts: bytes) -> bytes:
    message = label + b"".join(len(p).to_bytes(4, "big") + p for p in parts)
    return hmac.new(token.encode(), message, hashlib.sha256).digest()


def shard_proof(token: str, client_nonce: bytes, shard_nonce: bytes, binding: bytes) -> bytes:
    return _mac(token, _SHARD_LABEL, client_nonce, shard_nonce, binding)


def client_proof(token: str, client_nonce: bytes, shard_nonce: bytes, binding: bytes) -> bytes:
    return _mac(token, _CLIENT_LABEL, shard_nonce, client_nonce, binding)


def check(expected: bytes, got: bytes, who: str) -> None:
    if not (isinstance(got, (bytes, bytearray)) and len(got) == len(expected)
            and hmac.compare_digest(expected, bytes(got))):
        raise HandshakeError(f"{who} did not prove it holds the run's token")


class ShardNonces:
    """A shard's gRPC nonces, checkable without keeping them: the random part, the issue
    time and a MAC under a key of this process alone. A session ticket (client nonce, shard
    nonce, client proof) is then checked on every call with no table a peer could fill, and
    dies with the process: a ticket a restarted shard's predecessor issued, or another
    shard's, is refused, and so is one older than SESSION_S."""

    SIZE = 16 + 8 + 16

    def __init__(self):
        self._key = secrets.token_bytes(32)

    def issue(self, now: float | None = None) -> bytes:
        body = secrets.token_bytes(16) + int(now if now is not None else time.time()
                                             ).to_bytes(8, "big")
        return body + hmac.new(self._key, body, hashlib.sha256).digest()[:16]

    def valid(self, nonce: bytes, now: float | None = None) -> bool:
        if len(nonce) != self.SIZE:
            return False
        body, tag = nonce[:24], nonce[24:]
        if not hmac.compare_digest(hmac.new(self._key, body, hashlib.sha256).digest()[:16], tag):
            return False
        age = (now if now is not None else time.time()) - int.from_bytes(body[16:], "big")
        return -60.0 <= age <= SESSION_S


def session_ticket(client_nonce: bytes, shard_nonce: bytes, proof: bytes) -> str:
    """The gRPC metadata value of a session: nothing in it is the token or opens another
    session, shard or process (ShardNonces)."""
    return ".".join(x.hex() for x in (client_nonce, shard_nonce, proof))


def parse_ticket(value) -> tuple[bytes, bytes, bytes] | None:
    try:
        text = value if isinstance(value, str) else bytes(value).decode("ascii")
        parts = text.split(".")
        if len(parts) != 3 or len(text) > 512:
            return None
        client, shard, proof = (bytes.fromhex(p) for p in parts)
    except (ValueError, UnicodeDecodeError, TypeError):
        return None
    if len(client) != NONCE_BYTES or len(proof) != PROOF_BYTES:
        return None
    return client, shard, proof


def write_private_json(path, data) -> None:
    """Write `data` as JSON readable and writable by this user only: the file is created
    with mode 0600 (never wider, not even for a moment) beside `path`, then renamed over it,
    so a reader never sees half a file."""
    import json
    from pathlib import Path

    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def connect_host(bind: str) -> str:
    """The host a client on this machine dials for a shard bound to `bind`."""
    if bind in ("0.0.0.0", ""):
        return "127.0.0.1"
    if bind == "::":
        return "[::1]"
    return f"[{bind}]" if ":" in bind else bind


def ready_file_locator(path, host: str):
    """`locate` for ps.shard_client.ShardClient: () -> ("host:port", the ready file's dict),
    or None while the file is missing (the shard is restarting)."""
    import json
    from pathlib import Path

    path = Path(path)

    def locate():
        try:
            info = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return f"{host}:{int(info['port'])}", info
    return locate
