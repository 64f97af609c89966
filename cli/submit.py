"""``relay-trio submit``: a job's options (its payload as JSON, the backoff's short forms)
made into one submit.
"""

from __future__ import annotations

from typing import Any

import click
import orjson

from relay.protocol.model import UNIQUE_FOR, WIRE_PRIORITIES
from relay_cli.calls import call, print_json
from relay_cli.options import BACKOFF_FORMS, address_option, json_option, parse_backoff


def _payload_option(ctx: click.Context, param: click.Parameter, value: str) -> Any:
    text = click.get_text_stream("stdin").read() if value == "-" else value
    if not text.strip():
        raise click.BadParameter("empty; give a JSON value" + (" on stdin" if value == "-" else ""))
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise click.BadParameter(f"not valid JSON: {exc}") from None


def _backoff_option(ctx: click.Context, param: click.Parameter, value: str | None):
    return None if value is None else parse_backoff(value)


@click.command()
@click.argument("queue")
@click.option(
    "--payload", required=True, callback=_payload_option, metavar="JSON",
    help="The job's payload, any JSON value; '-' reads it from stdin.",
)  # fmt: skip
@click.option("--priority", type=click.Choice(WIRE_PRIORITIES), help="Default: normal.")
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    help="Retries after the first attempt (default: the queue's, else 3).",
)
@click.option("--delay-ms", type=click.IntRange(min=0), help="Run no sooner than this from now.")
@click.option(
    "--run-at", type=click.IntRange(min=0), metavar="MS", help="Run at this time (ms since epoch)."
)
@click.option(
    "--backoff", callback=_backoff_option, metavar="SPEC",
    help=f"Wait between retries: {BACKOFF_FORMS}; default exp:1s:5m.",
)  # fmt: skip
@click.option("--idempotency-key", metavar="KEY", help="Submit at most once per queue and key.")
@click.option(
    "--unique-key", metavar="KEY",
    help="At most one unfinished job of the queue with this key: while one is, the submit "
    "answers it.",
)  # fmt: skip
@click.option(
    "--unique-for", type=click.Choice(UNIQUE_FOR),
    help="How long --unique-key holds: while the job is unfinished (default) or queued "
    "(until a worker leases it).",
)  # fmt: skip
@click.option(
    "--timeout-ms", type=click.IntRange(min=1), metavar="MS",
    help="Longest run of one attempt: the worker stops the handler then and the attempt "
    "fails (retried as any failure).",
)  # fmt: skip
@address_option
@json_option
def submit(
    queue: str,
    payload: Any,
    priority: str | None,
    retries: int | None,
    delay_ms: int | None,
    run_at: int | None,
    backoff: dict[str, Any] | None,
    idempotency_key: str | None,
    unique_key: str | None,
    unique_for: str | None,
    timeout_ms: int | None,
    address: str,
    as_json: bool,
) -> None:
    """Submit a job to QUEUE; print its id and state (and "duplicate" when the idempotency
    key or the unique key matched an earlier job)."""
    if delay_ms is not None and run_at is not None:
        raise click.UsageError("give --delay-ms or --run-at, not both")
    if unique_for is not None and unique_key is None:
        raise click.UsageError("--unique-for needs --unique-key")
    result = call(address, lambda client: client.submit(
        queue, payload, priority=priority, retries=retries, delay_ms=delay_ms, run_at=run_at,
        backoff=backoff, idempotency_key=idempotency_key, unique_key=unique_key,
        unique_for=unique_for, timeout_ms=timeout_ms,
    ))  # fmt: skip
    if as_json:
        print_json(result)
    else:
        click.echo(f"{result.job_id} {result.state}" + (" duplicate" if result.duplicate else ""))
