"""The options the client commands share, and what they read: ``--address`` (env
``RELAY_ADDRESS``) with ``--tls``, ``--tls-ca`` (env ``RELAY_TLS_CA``), ``--token-file`` and
``--timeout`` (``address_option``; ``client_target``, ``client_token`` and
``client_timeout`` read them), ``--json``, and the checks of a ``--queue`` name and of a
JOB argument (a whole job id, or its start as the tables show it).

Imports no more than click and the light parts of relay (its model's names): every
command's module imports this one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

from relay.client.tls import TLS_SCHEME
from relay.protocol.model import ID_ABBREV_MIN, QUEUE_NAME_RE, job_id_keys, parse_job_id

DEFAULT_ADDRESS = "127.0.0.1:7400"
# A plain address may say so; the clients take it without.
TCP_SCHEME = "tcp://"
# How long a client command waits for the server to connect and answer, by default. A
# server on this machine or its network answers in milliseconds; one that has not answered
# in this long is down, hung or not a relay-trio server.
DEFAULT_TIMEOUT_S = 10.0


def parse_address(text: str, option: str = "--address") -> tuple[str, int]:
    scheme, sep, _ = text.partition("://")
    if sep:
        known = f"{scheme}://" in (TCP_SCHEME, TLS_SCHEME)
        problem = "give HOST:PORT here" if known else (
            f"{scheme}:// is neither {TCP_SCHEME} nor {TLS_SCHEME}"
        )  # fmt: skip
        raise click.BadParameter(f"{text!r}: {problem}", param_hint=option)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise click.BadParameter(f"{text!r} is not HOST:PORT", param_hint=option)
    return host.strip("[]"), int(port)


def _check_address(ctx: click.Context, param: click.Parameter, value: str) -> str:
    value = value.removeprefix(TCP_SCHEME)
    try:
        parse_address(value.removeprefix(TLS_SCHEME))
    except click.BadParameter as exc:
        raise click.BadParameter(exc.message) from None  # click names the option
    return value


def read_client_token(path: str | None) -> str | None:
    """The token a client command says hello with: the one in the file at ``path``
    (its only line that is not blank or a ``#`` comment), else RELAY_AUTH_TOKEN, else
    None. Never a command-line value: argv is visible to every user of the machine."""
    if path is None:
        return os.environ.get("RELAY_AUTH_TOKEN") or None
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line for raw in f if (line := raw.strip()) and not line.startswith("#")]
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {path}: {exc}") from None
    if len(lines) != 1 or len(lines[0].split()) != 1:
        raise click.BadParameter(f"{path}: expected one token on one line")
    return lines[0]


def _token_option(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    ctx.meta["relay.token"] = read_client_token(value)


def client_token() -> str | None:
    """The token of the running command (--token-file or RELAY_AUTH_TOKEN)."""
    return click.get_current_context().meta.get("relay.token")


def _keep_option(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    # Kept on the context rather than passed to every command: see client_target and
    # client_timeout.
    ctx.meta[f"relay.{param.name}"] = value
    return value


def _keep_tls_ca(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """--tls-ca, checked here: a file that holds no CA certificate is the user's to fix
    (exit 2), not a failed connection."""
    if value is not None:
        import ssl

        try:
            ssl.create_default_context(cafile=value)
        except (ssl.SSLError, OSError) as exc:
            reason = getattr(exc, "reason", None) or exc.strerror or str(exc)
            raise click.BadParameter(
                f"{value}: no CA certificate in PEM form ({str(reason).lower().replace('_', ' ')})"
            ) from None
    _keep_option(ctx, param, value)


def client_timeout(default: float = DEFAULT_TIMEOUT_S) -> float:
    """The running command's ``--timeout`` in seconds (``default`` if not given)."""
    value = click.get_current_context().meta.get("relay.timeout")
    return default if value is None else value


def address_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--address``; ``--token-file`` for a server with access control; ``--tls`` and
    ``--tls-ca``, which ``client_target`` reads; ``--timeout``, which ``client_timeout``
    reads."""
    fn = click.option(
        "--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS",
        expose_value=False, callback=_keep_option,
        help="Give up on a server that has not connected and answered within this long "
        f"(default {DEFAULT_TIMEOUT_S:g}).",
    )(fn)  # fmt: skip
    fn = click.option(
        "--token-file", metavar="PATH", expose_value=False, callback=_token_option,
        help="A file holding the access token to say hello with (default: env "
        "RELAY_AUTH_TOKEN).",
    )(fn)  # fmt: skip
    fn = click.option(
        "--tls-ca", envvar="RELAY_TLS_CA", type=click.Path(exists=True, dir_okay=False),
        metavar="PATH", expose_value=False, callback=_keep_tls_ca,
        help="Use TLS, and trust the CA certificate(s) in this PEM file (env RELAY_TLS_CA).",
    )(fn)  # fmt: skip
    fn = click.option(
        "--tls", is_flag=True, expose_value=False, callback=_keep_option,
        help="Use TLS, verifying the server with the system's trust store.",
    )(fn)  # fmt: skip
    return click.option(
        "--address", envvar="RELAY_ADDRESS", default=DEFAULT_ADDRESS, show_default=True,
        callback=_check_address, metavar="[tls://]HOST:PORT",
        help="The server (env RELAY_ADDRESS); a tls:// address uses TLS.",
    )(fn)  # fmt: skip


def client_target(address: str) -> tuple[str, str | None]:
    """The address to connect to and the CA file to trust, after the current command's
    ``--tls`` and ``--tls-ca``: either makes the address tls:// (the form errors name)."""
    ctx = click.get_current_context(silent=True)
    meta = ctx.meta if ctx is not None else {}
    tls_ca = meta.get("relay.tls_ca")
    if (meta.get("relay.tls") or tls_ca) and not address.startswith(TLS_SCHEME):
        address = TLS_SCHEME + address
    return address, tls_ca


json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def check_queues(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]):
    for name in value:
        if not QUEUE_NAME_RE.fullmatch(name):
            raise click.BadParameter(f"{name!r}: a queue name is 1-128 characters of "
                                     "[A-Za-z0-9._:-]")  # fmt: skip
    return value


# What a JOB argument's help says it may be.
JOB_HELP = (
    f"JOB is a job id, or its start (job_ and at least {ID_ABBREV_MIN} of its hex digits) "
    "if only one job's id begins so: as `dead list` and `top` show it, shortened to the "
    "start that no other job's id had when shown."
)


def check_job(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A JOB argument: a whole job id, or an abbreviated one (``abbreviated``)."""
    if value is None or parse_job_id(value) is not None or job_id_keys(value) is not None:
        return value
    raise click.BadParameter(
        f"{value!r} is not a job id: job_ and 16 hex digits, or the first {ID_ABBREV_MIN} "
        "or more of them"
    )


def abbreviated(job_id: str) -> bool:
    """Whether a JOB argument (``check_job``) is shorter than a whole id: then the command
    asks for the one job whose id begins with it (``inspect`` with ``prefix``)."""
    return parse_job_id(job_id) is None


# -- durations, rates and backoffs (``submit --backoff``, ``queue set``) -------------------

# A duration's units, in milliseconds; a number without one is milliseconds, as the wire's
# ``*_ms`` fields (and ``submit --backoff fixed:500``) have always been.
DURATION_UNITS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
DURATION_FORMS = "a number and ms, s, m, h or d (1500ms, 30s, 5m); a bare number is ms"
RATE_FORMS = "LIMIT/PERIOD: 100/s, 10/1m, 5/500ms"
BACKOFF_FORMS = "fixed:DELAY or exp:BASE:MAX[:nojitter] (durations: fixed:10s, exp:1s:5m)"


def parse_duration(text: str) -> int:
    """ "1500ms", "30s", "1.5s", "5m", "2h", "1d" or "500" (ms) as whole milliseconds.
    Raises ValueError on anything else, and on a part of a millisecond."""
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = DURATION_UNITS.get(text[len(number) :] or "ms")
    if unit is None or not number or not number.replace(".", "", 1).isdigit():
        raise ValueError(f"{text!r}: expected {DURATION_FORMS}")
    whole, _, fraction = number.partition(".")
    ms = int(whole or 0) * unit + int(fraction or 0) * unit // 10 ** len(fraction)
    if int(fraction or 0) * unit % 10 ** len(fraction):
        raise ValueError(f"{text!r}: not a whole number of milliseconds")
    return ms


def parse_rate(text: str) -> dict[str, int]:
    """ "LIMIT/PERIOD" (``100/s``, ``10/1m``, ``5/500ms``: a period's unit alone is one of
    it) as the wire's ``{"limit", "period_ms"}``. Raises ValueError on anything else."""
    limit, sep, period = text.partition("/")
    if not sep or not limit.isdigit():
        raise ValueError(f"{text!r}: expected {RATE_FORMS}")
    try:
        period_ms = parse_duration("1" + period if period in DURATION_UNITS else period)
    except ValueError:
        raise ValueError(f"{text!r}: expected {RATE_FORMS}") from None
    return {"limit": int(limit), "period_ms": period_ms}


def parse_backoff(text: str) -> dict[str, Any]:
    """ "fixed:DELAY" or "exp:BASE:MAX[:nojitter]" (each a duration, ``parse_duration``:
    "fixed:500" is 500 ms, "exp:1s:5m") as the wire's backoff object."""
    kind, *parts = text.split(":")
    jitter = True
    if kind in ("exp", "exponential") and parts and parts[-1] in ("jitter", "nojitter"):
        jitter = parts.pop() == "jitter"
    try:
        numbers = [parse_duration(part) for part in parts]
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected {BACKOFF_FORMS}") from None
    if kind == "fixed" and len(numbers) == 1:
        return {"kind": "fixed", "delay_ms": numbers[0]}
    if kind in ("exp", "exponential") and len(numbers) == 2:
        base, top = numbers
        return {"kind": "exponential", "base_ms": base, "max_ms": top, "jitter": jitter}
    raise click.BadParameter(f"{text!r}: expected {BACKOFF_FORMS}")
