"""The lease+ack consumer of the raw scenarios, and the process that runs one of them
(``lease_ack_processes`` starts several: ``python -m relay_scripts.bench.consumer``)."""

from __future__ import annotations

import os
import sys

import trio

from relay_scripts.bench.conn import Conn


async def consume_raw(
    address, total: int, count: int, queue: str = "bench", batch_acks: bool = False
) -> int:
    """Lease up to ``count`` at a time and pipeline the acks (or send them as one
    ``ack_batch``); stop after ``total`` jobs or when the queue is empty. Returns jobs done."""
    conn = await Conn.open(address)
    worker = f"bench-{os.getpid()}-{id(conn)}"
    done = 0
    while done < total:
        reply = await conn.call("lease", queues=[queue], worker_id=worker, count=count)
        jobs = reply["jobs"]
        if not jobs:
            break
        if batch_acks:
            acks = [{"job_id": j["job_id"], "token": j["token"]} for j in jobs]
            reply = await conn.call("ack_batch", worker_id=worker, acks=acks)
            if not all(r["ok"] for r in reply["results"]):
                raise RuntimeError(f"an ack was refused: {reply}")
        else:
            lines = b"".join(
                conn.line("ack", job_id=j["job_id"], worker_id=worker, token=j["token"])
                for j in jobs
            )
            await conn.stream.send_all(lines)
            await conn.read_count(len(jobs))
        done += len(jobs)
    await conn.aclose()
    return done


def consume_main(address: str, per: str, count: str, acks: str) -> None:
    """A consumer process: connect, say ready, wait for go, consume, print how many."""
    host, port = address.rsplit(":", 1)

    async def run() -> int:
        conn = await Conn.open((host, int(port)))
        await conn.call("ping")
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        await conn.aclose()
        return await consume_raw(
            (host, int(port)), int(per), int(count), batch_acks=acks == "batch"
        )

    print(trio.run(run), flush=True)


if __name__ == "__main__":
    consume_main(*sys.argv[1:5])
