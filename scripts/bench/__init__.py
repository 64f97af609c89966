"""relay-bench: throughput, latency and memory of a relay-trio server, measured honestly.

    relay-bench                 # full run (a few minutes), server started on a temp db
    relay-bench --quick         # reduced sizes, one run each: under 30 s
    relay-bench --json out.json --address 127.0.0.1:7400   # against a running server
    relay-bench --tls           # the submit scenarios over plain TCP and over TLS
    relay-bench --watchers      # submit and lease+ack with no, an idle, an all-events watcher

Each scenario runs ``--runs`` times; the table shows the median with min and max. The
server is a subprocess with ``synchronous=FULL`` unless stated: every ok reply it sends is
fsync'd. Load generators use raw sockets and pre-encoded requests, and count replies
without parsing them, so that the generator is not what is measured. See
docs/benchmarking.md.

The modules, each importing only those listed above it:

    conn        a raw NDJSON connection: pre-encoded lines out, replies counted
    sampling    what is read off the machine: CPU seconds, memory, /metrics, an fsync
    postgres    a fresh PostgreSQL database per group of scenarios, and its counters
    servers     the server(s) under test: started, addressed, stopped
    results     one scenario's result, which measuring fills and reporting shows
    measure     one scenario's runs, timed, with its memory, batches and cost per job
    consumer    the lease+ack consumer, also run as a process of its own
    loads       what each scenario does to the server (the load generators)
    scenarios   the scenarios of a run and their sizes
    watchers    what a watcher costs (--watchers)
    report      the tables, the closing line and the JSON
    suite       which scenarios a run takes, on which servers
    main        the command line
"""
