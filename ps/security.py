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

import ipaddress
import os
import re
import secrets

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
