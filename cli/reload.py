"""``relay-trio reload``: the server reads its token file and its TLS certificate and key
again (the ``reload`` op; SIGHUP does the same), and says what it put in force."""

from __future__ import annotations

from typing import Any

import click

from relay.client.client import Client
from relay_cli.calls import call, plural, print_json
from relay_cli.errors import fail
from relay_cli.options import address_option, json_option


@click.command()
@address_option
@json_option
def reload(address: str, as_json: bool) -> None:
    """Have the server read its token file and TLS certificate and key again, without a
    restart: new tokens work at once, removed ones are refused at their next hello, and
    their connections are closed after the server's --token-grace-ms. A file that cannot
    be used changes nothing and is named here (exit code 1). Needs an admin token."""

    async def reloading(client: Client) -> dict[str, Any]:
        return await client.reload()

    reply = call(address, reloading)
    if as_json:
        print_json(reply)
    else:
        tokens = reply["tokens"]
        said = [
            "no token file" if tokens is None else f"{plural(tokens, 'token')} in force",
            "a new certificate in force" if reply["tls"] else "no new certificate",
        ]
        if reply["closing"]:
            said.append(f"{plural(reply['closing'], 'connection')} of removed tokens close "
                        f"in {reply['grace_ms'] / 1000:g} s")  # fmt: skip
        # (A file it could not use is kept out, and said on stderr: then what is in force
        # is the file before, not a reload.)
        click.echo(("kept" if reply["errors"] else "reloaded") + ": " + ", ".join(said))
    if reply["errors"]:
        fail("; ".join(reply["errors"]))
