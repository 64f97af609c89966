"""``relay-trio server``'s start-up as a user meets it, through the console script as a
subprocess: a listener that cannot be opened is one line naming it; on a terminal the logs
are short lines with a summary once it serves, JSON lines when piped; Ctrl-C in any phase
stops it without a traceback, and a second one at once.

A terminal is a pty (``os.openpty``) given to the process as its stderr. Ports are taken
with plain sockets on 127.0.0.1 port 0; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sqlite3
import subprocess
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
import pytest
import trio

import relay
from tests import pg

from .conftest import BOUND_S, RELAY, assert_one_line_error, cli_env, relay_trio

LOOPBACK_ANY = "127.0.0.1:0"
TOKEN = "a-token-long-enough-for-the-server"


def server_args(db: Path, **addresses: str) -> list[str]:
    """``server`` on ``db``, every listener on a free loopback port unless given."""
    chosen = {"address": LOOPBACK_ANY, "metrics_address": LOOPBACK_ANY,
              "ws_address": LOOPBACK_ANY, **addresses}  # fmt: skip
    args = ["server", "--db", str(db)]
    for name, value in chosen.items():
        args += [f"--{name.replace('_', '-')}", value]
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    """The commands' environment, with no log format chosen unless given."""
    values = cli_env(**extra)
    if "RELAY_LOG_FORMAT" not in extra:
        values.pop("RELAY_LOG_FORMAT", None)
    return values


def json_events(stderr: str) -> list[dict]:
    return [orjson.loads(line) for line in stderr.splitlines() if line.startswith("{")]


# -- a listener that cannot be opened ---------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "listener"),
    [("--metrics-address", "metrics"), ("--ws-address", "WebSocket"), ("--address", "jobs")],
)
async def test_a_port_in_use_is_one_line_naming_its_listener(tmp_path, option, listener):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        name = option.removeprefix("--").replace("-", "_")
        result = await relay_trio(*server_args(tmp_path / "relay.db", **{name: busy}), env=env())
    assert_one_line_error(result, f"{listener} listener ({option})", busy, "already in use",
                          code=2)  # fmt: skip
    assert "Trio" not in result.stderr and "Errno" not in result.stderr, result.stderr


async def test_an_address_of_another_machine_is_one_line(tmp_path):
    # 192.0.2.1 is TEST-NET-1 (RFC 5737): never an address of this machine.
    args = server_args(tmp_path / "relay.db", address="192.0.2.1:0")
    result = await relay_trio(*args, "--insecure", env=env())
    assert_one_line_error(
        result, "jobs listener (--address)", "192.0.2.1:0", "not an address of this machine",
        code=2,
    )  # fmt: skip


async def test_a_database_error_is_not_reported_as_a_listener(tmp_path):
    """--db naming a directory fails in the store, however it is worded: never as a
    listener that cannot listen."""
    result = await relay_trio(*server_args(tmp_path), env=env())
    assert result.code != 0, result
    assert "listen" not in result.stderr, result.stderr


async def test_a_postgresql_server_it_cannot_reach_exits_1_to_be_restarted(tmp_path):
    """PostgreSQL down (or still starting) when the server starts: a failure that may
    pass, exit 1, which the systemd unit restarts (not 2, a configuration to fix, which
    it does not: RestartPreventExitStatus=2). Found from outside, 2026-12-04."""
    url = f"postgresql://postgres@127.0.0.1:{free_port()}/relay"  # (nobody listens there)
    result = await relay_trio(*server_args(url), env=env())  # type: ignore[arg-type]
    assert_one_line_error(result, "cannot connect to", "127.0.0.1", "refused", code=1)
    assert "PostgreSQL runs there" in result.stderr
    unit = (Path(relay.__file__).parents[1] / "docs/deploy/relay-trio.service").read_text()
    assert "RestartPreventExitStatus=2" in unit and "Restart=on-failure" in unit
    assert "StartLimitIntervalSec=0" in unit  # (restarted for as long as it is down)


async def test_a_postgresql_database_refusing_the_connection_exits_1_naming_it(pg_url):
    """Reached, and refused (no such database): libpq tells it from a server that is down
    only by its message's text, so it is the same failure, exit 1, with the server's word."""
    url = pg.server_url(pg_url).rpartition("/")[0] + "/relay_no_such_database"
    result = await relay_trio(*server_args(url), env=env())  # type: ignore[arg-type]
    assert_one_line_error(result, "cannot connect to", "relay_no_such_database", code=1)
    assert "does not exist" in result.stderr


@pytest.mark.parametrize(("variable", "value"), [("RELAY_LOG", "loud"),
                                                 ("RELAY_LOG_FORMAT", "xml")])  # fmt: skip
async def test_an_unknown_log_setting_is_one_line(tmp_path, variable, value):
    result = await relay_trio(*server_args(tmp_path / "relay.db"), env=env(**{variable: value}))
    assert_one_line_error(result, variable, repr(value), code=2)
    assert not (tmp_path / "relay.db").exists()


# -- on a terminal, and not ----------------------------------------------------------------


class Terminal:
    """A pty whose other end is a process's stderr; ``text`` is what it has written so far
    (line ends as "\\n").

    The test keeps its own copy of the other end open: when the last copy closes, Linux may
    answer a read of this end with EIO before the bytes written just before. ``finish``
    writes an end mark after the process's last bytes and reads up to it instead.
    """

    END = b"\x00end of the process's output\x00"

    def __init__(self, master: int, slave: int) -> None:
        self._stream = trio.lowlevel.FdStream(master)
        self._slave = slave
        self._raw = b""
        self.closed = trio.Event()
        self._changed = trio.Event()

    @property
    def text(self) -> str:
        raw = self._raw.split(self.END)[0]
        return raw.replace(b"\r\n", b"\n").decode(errors="replace")

    async def pump(self) -> None:
        try:
            while self.END not in self._raw:
                data = await self._stream.receive_some(65536)
                self._raw += data
                self._changed.set()
                self._changed = trio.Event()
        finally:
            self.closed.set()
            self._changed.set()
            await self._stream.aclose()

    async def finish(self) -> None:
        """After the process has exited: read all that it wrote (once is enough)."""
        if self._slave < 0:
            return
        os.write(self._slave, self.END)
        try:
            with trio.fail_after(BOUND_S):
                await self.closed.wait()
        finally:
            os.close(self._slave)
            self._slave = -1

    async def wait_for(self, fragment: str) -> None:
        with trio.fail_after(BOUND_S):
            while fragment not in self.text:
                assert not self.closed.is_set(), f"{fragment!r} never came:\n{self.text}"
                await self._changed.wait()


@asynccontextmanager
async def on_terminal(
    args: list[str], environment: dict[str, str]
) -> AsyncIterator[tuple[trio.Process, Terminal]]:
    """Run ``relay-trio *args`` with a pty as its stderr; kill it on the way out if needed."""
    master, slave = os.openpty()
    try:
        process = await trio.lowlevel.open_process(
            [str(RELAY), *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=slave, env=environment,
        )  # fmt: skip
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    terminal = Terminal(master, slave)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(terminal.pump)
        try:
            yield process, terminal
        finally:
            if process.returncode is None:
                process.kill()
            with trio.CancelScope(shield=True):
                with trio.move_on_after(BOUND_S):
                    await process.wait()
                await terminal.finish()


async def exit_code(process: trio.Process, terminal: Terminal | None = None) -> int:
    """The exit code (and with ``terminal``, all it wrote there), within a bounded wait."""
    with trio.fail_after(BOUND_S):
        code = await process.wait()
    if terminal is not None:
        await terminal.finish()
    return code


async def test_on_a_terminal_a_summary_then_short_lines_and_ctrl_c_says_how_long(tmp_path):
    db = tmp_path / "relay.db"
    args = [*server_args(db), "--shutdown-timeout-ms", "2500"]
    async with on_terminal(args, env()) as (process, terminal):
        await terminal.wait_for("Ctrl-C stops it")
        process.send_signal(signal.SIGINT)
        code = await exit_code(process, terminal)
    text = terminal.text
    assert code == 0, text
    assert "Traceback" not in text and "{" not in text, text
    summary = text[: text.index("Ctrl-C stops it")]
    for fragment in ("is serving", "jobs        127.0.0.1:", "metrics     http://127.0.0.1:",
                     "dashboard   http://127.0.0.1:", "WebSocket   ws://127.0.0.1:",
                     f"database    {db} (SQLite)", "synchronous=full", "tokens      off",
                     "TLS         off"):  # fmt: skip
        assert fragment in summary, (fragment, text)
    # The dashboard is served where the metrics are.
    metrics_port = summary.split("metrics     http://127.0.0.1:")[1].split("/")[0]
    assert f"dashboard   http://127.0.0.1:{metrics_port}/" in summary, text
    assert "stopping (SIGINT): requests in flight get up to 2.5 s" in text, text
    lines = text.splitlines()
    stopped = next(line for line in lines if "server.stopped" in line)
    assert stopped.split()[1:3] == ["info", "server.stopped"], stopped
    assert len(stopped) < 80, stopped


async def test_json_lines_when_forced_on_a_terminal(tmp_path):
    args = [*server_args(tmp_path / "relay.db"), "--shutdown-timeout-ms", "2500"]
    async with on_terminal(args, env(RELAY_LOG_FORMAT="json")) as (process, terminal):
        await terminal.wait_for('"server.started"')
        process.send_signal(signal.SIGTERM)
        assert await exit_code(process, terminal) == 0, terminal.text
    lines = terminal.text.splitlines()
    assert lines and all(line.startswith("{") for line in lines), terminal.text
    events = {e["event"]: e for e in map(orjson.loads, lines)}
    assert "server.stopped" in events, lines
    # What the terminal's line says, for programs: how long the shutdown may take.
    signalled = events["shutdown.signal"]
    assert (signalled["signal"], signalled["starting"]) == ("SIGTERM", False), signalled
    assert signalled["shutdown_timeout_ms"] == 2500, signalled


async def piped_stderr(db: Path, environment: dict[str, str]) -> str:
    """A server's stderr through a pipe, from its start to its exit (0) after SIGTERM."""
    process = await trio.lowlevel.open_process(
        [str(RELAY), *server_args(db)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, env=environment,
    )  # fmt: skip
    assert process.stderr is not None
    received = b""
    signalled = False
    try:
        with trio.fail_after(BOUND_S):
            while b"server.stopped" not in received:
                if not signalled and (b"server.started" in received or b"is serving" in received):
                    process.send_signal(signal.SIGTERM)
                    signalled = True
                data = await process.stderr.receive_some(65536)
                assert data, received
                received += data
        code = await exit_code(process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert code == 0, received
    return received.decode()


async def test_piped_json_lines_unless_text_is_asked_for(tmp_path):
    text = await piped_stderr(tmp_path / "relay.db", env())
    assert next(e["event"] for e in json_events(text)) == "server.started", text
    assert all(line.startswith("{") for line in text.splitlines()), text
    text = await piped_stderr(tmp_path / "relay.db", env(RELAY_LOG_FORMAT="text"))
    assert "is serving" in text and "{" not in text, text
    # --log-format's variable; "text" is the former name of "human".
    text = await piped_stderr(tmp_path / "relay.db", env(RELAY_LOG_FORMAT="human"))
    assert "is serving" in text and "{" not in text, text


# -- Ctrl-C in every phase ------------------------------------------------------------------


async def open_fifo_writer(fifo: Path) -> int:
    """Open ``fifo`` for writing once a reader has it open (the server reading its token
    file, and blocked there until something is written)."""
    with trio.fail_after(BOUND_S):
        while True:
            try:
                return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise
            await trio.sleep(0.01)


async def reading_a_pipe(pid: int) -> None:
    """Wait until process ``pid`` is blocked reading a pipe (Linux's /proc): a signal sent
    then interrupts the read, and its handler runs. (One sent a little earlier, after the
    pipe opened and before the read began, would wait for the read to return: a signal's
    Python handler runs between bytecodes or when a system call is interrupted.)"""
    wchan = trio.Path(f"/proc/{pid}/wchan")
    with trio.fail_after(BOUND_S):
        while "pipe_read" not in await wchan.read_text():  # noqa: ASYNC110 (another process)
            await trio.sleep(0.01)


async def test_ctrl_c_during_start_up_exits_0_without_a_traceback(tmp_path):
    fifo = tmp_path / "tokens"
    os.mkfifo(fifo)
    db = tmp_path / "relay.db"
    process = await trio.lowlevel.open_process(
        [str(RELAY), *server_args(db), "--auth-token-file", str(fifo)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=env(RELAY_LOG_FORMAT="json"),
    )  # fmt: skip
    try:
        writer = await open_fifo_writer(fifo)
        await reading_a_pipe(process.pid)
        process.send_signal(signal.SIGINT)  # while it reads its token file
        try:
            os.write(writer, f"{TOKEN}\n".encode())
        finally:
            os.close(writer)
        assert process.stderr is not None
        with trio.fail_after(BOUND_S):
            stderr = b""
            while data := await process.stderr.receive_some(65536):
                stderr += data
        code = await exit_code(process)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = stderr.decode()
    assert code == 0, text
    assert "Traceback" not in text, text
    events = json_events(text)
    assert [e["event"] for e in events] == ["shutdown.signal"], text  # it never served
    assert events[0]["starting"] is True and events[0]["signal"] == "SIGINT", events


async def test_a_second_signal_exits_130_while_start_up_is_stuck(tmp_path):
    fifo = tmp_path / "tokens"
    os.mkfifo(fifo)
    process = await trio.lowlevel.open_process(
        [str(RELAY), *server_args(tmp_path / "relay.db"), "--auth-token-file", str(fifo)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=env(RELAY_LOG_FORMAT="json"),
    )  # fmt: skip
    assert process.stderr is not None
    writer = await open_fifo_writer(fifo)
    stderr = b""
    try:
        # Nothing is ever written: start-up would wait forever. The first signal is said
        # at once; the second ends the process.
        await reading_a_pipe(process.pid)
        process.send_signal(signal.SIGINT)
        with trio.fail_after(BOUND_S):
            while b"shutdown.signal" not in stderr:
                data = await process.stderr.receive_some(65536)
                assert data, stderr
                stderr += data
            await reading_a_pipe(process.pid)
            process.send_signal(signal.SIGTERM)
            while data := await process.stderr.receive_some(65536):
                stderr += data
        code = await exit_code(process)
    finally:
        os.close(writer)
        if process.returncode is None:
            process.kill()
            await process.wait()
    text = stderr.decode()
    assert code == 130, text
    assert "Traceback" not in text, text
    events = json_events(text)
    assert [e["event"] for e in events] == ["shutdown.signal", "shutdown.forced"], text
    assert events[0]["starting"] is True and events[1]["signal"] == "SIGTERM", events


async def has_open(pid: int, path: Path) -> None:
    """Wait until process ``pid`` has ``path`` open (Linux's /proc)."""
    fds = trio.Path(f"/proc/{pid}/fd")
    with trio.fail_after(BOUND_S):
        while True:
            links = []
            for fd in await fds.iterdir():
                with contextlib.suppress(OSError):  # closed meanwhile
                    links.append(os.readlink(fd))
            if str(path) in links:
                return
            await trio.sleep(0.01)


async def test_a_second_ctrl_c_exits_130_while_the_database_opens(tmp_path):
    """Opening the database waits here for a lock another connection holds (SQLite's
    busy timeout: 5 s), as a quick_check of a large file or a slow migration would keep
    it busy: the signals are still handled at once, and the second one exits."""
    db = tmp_path / "relay.db"
    db.touch()
    lock = sqlite3.connect(db, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")
        async with on_terminal(server_args(db), env()) as (process, terminal):
            await has_open(process.pid, db)
            process.send_signal(signal.SIGINT)
            await terminal.wait_for("before serving")
            started = trio.current_time()
            process.send_signal(signal.SIGINT)
            code = await exit_code(process, terminal)
            assert trio.current_time() - started < 2.0  # not at the busy timeout's end
    finally:
        lock.close()
    assert code == 130, terminal.text
    assert "Traceback" not in terminal.text, terminal.text


def blocked_on_a_pipe(pid: int) -> bool:
    """Whether a thread of process ``pid`` waits in a write to a full pipe."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # the thread has just ended
            if "pipe_write" in (task / "wchan").read_text():
                return True
    return False


@asynccontextmanager
async def stderr_a_full_pipe(args: list[str]) -> AsyncIterator[trio.Process]:
    """The server, its stderr a pipe that is full and that nobody reads (a stuck log
    collector), once a write of its logs is blocked there."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    with contextlib.suppress(BlockingIOError):
        while True:
            os.write(write_end, b"x" * 65536)
    os.set_blocking(write_end, True)
    try:
        process = await trio.lowlevel.open_process(
            [str(RELAY), *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=write_end, env=env(RELAY_LOG_FORMAT="json"),
        )  # fmt: skip
        try:
            with trio.fail_after(BOUND_S):
                while not blocked_on_a_pipe(process.pid):  # noqa: ASYNC110
                    await trio.sleep(0.01)
            yield process
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    finally:
        os.close(read_end)
        os.close(write_end)


async def test_a_stderr_nobody_reads_stops_neither_the_service_nor_the_shutdown(tmp_path):
    """The log writes block, in a thread of their own: the server still answers, and a
    signal still stops it gracefully, the lines it could not write given up on."""
    port = free_port()
    args = server_args(tmp_path / "relay.db", address=f"127.0.0.1:{port}")
    async with stderr_a_full_pipe(args) as process:
        with trio.fail_after(BOUND_S):
            async with relay.open_client(f"127.0.0.1:{port}") as client:
                await client.ping()
                await client.submit("email", {"to": "a@example.com"})
        process.send_signal(signal.SIGTERM)
        assert await exit_code(process) == 0


async def test_a_second_ctrl_c_exits_130_while_stderr_is_a_full_pipe(tmp_path):
    async with stderr_a_full_pipe(server_args(tmp_path / "relay.db")) as process:
        # Two signals of two kinds, so that both are pending together (a second of the
        # same kind could merge with the first before its handler ran).
        process.send_signal(signal.SIGINT)
        process.send_signal(signal.SIGTERM)
        assert await exit_code(process) == 130


async def test_a_second_ctrl_c_exits_130_while_the_shutdown_is_held_up(tmp_path):
    """A submit waits for the database's write lock (held here, as a backup tool may),
    so the graceful shutdown waits for it; a second Ctrl-C does not."""
    db = tmp_path / "relay.db"
    args = [*server_args(db), "--shutdown-timeout-ms", "30000"]
    async with on_terminal(args, env()) as (process, terminal):
        await terminal.wait_for("Ctrl-C stops it")
        address = terminal.text.split("jobs        ")[1].split()[0]
        host, _, port = address.rpartition(":")
        lock = sqlite3.connect(db, timeout=BOUND_S, isolation_level=None)
        try:
            lock.execute("BEGIN IMMEDIATE")
            with trio.fail_after(BOUND_S):
                stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                await stream.send_all(b'{"op": "submit", "id": 1, "queue": "q", "payload": 1}\n')
                process.send_signal(signal.SIGINT)
                await terminal.wait_for("stopping (SIGINT): requests in flight get up to 30 s")
                process.send_signal(signal.SIGINT)
                code = await exit_code(process, terminal)
        finally:
            lock.close()
    assert code == 130, terminal.text
    assert "Traceback" not in terminal.text, terminal.text
    assert "shutdown.forced" in terminal.text, terminal.text


async def test_a_signal_while_the_loop_starts_the_server_cancels_the_start_up(
    tmp_path, monkeypatch
):
    """In the trio run, before serve() has started (here: in the exposure check, in a
    thread): the first signal cancels the start-up, which ends without an error and
    without opening the database."""
    from relay.server import serve as serve_module
    from relay.server.core import ServerConfig
    from relay_cli.server import Signals, _run_server

    checking, release = threading.Event(), threading.Event()

    def slow_check(*args: object) -> list[str]:
        checking.set()
        release.wait(BOUND_S)
        return []

    monkeypatch.setattr(serve_module, "check_exposure", slow_check)
    db = tmp_path / "relay.db"
    config = ServerConfig(db=str(db), port=0, metrics_port=None)
    signals = Signals(config.shutdown_timeout_ms)  # not installed: its handler is called
    finished = trio.Event()

    async def run() -> None:
        await _run_server(config, signals)
        finished.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        assert await trio.to_thread.run_sync(checking.wait, BOUND_S)
        signals._handle(signal.SIGINT, None)
        release.set()
        with trio.fail_after(BOUND_S):
            await finished.wait()
    assert not db.exists()


def test_the_summary_of_a_server_with_tls_tokens_postgresql_and_no_metrics():
    from relay_cli.server import startup_summary

    text = startup_summary({
        "version": "1.2.3", "address": "[::1]:7400", "tls": True, "metrics": None,
        "websocket": "[::1]:7402", "db": "postgresql://relay:***@db.example:5432/jobs",
        "synchronous": "full", "tokens": 3, "shutdown_timeout_ms": 10_000, "startup_ms": 41,
    })  # fmt: skip
    lines = text.splitlines()
    assert lines[0] == "relay-trio 1.2.3 is serving (started in 41 ms)"
    rows = {line.split()[0]: " ".join(line.split()[1:]) for line in lines[1:-1]}
    assert rows == {
        "jobs": "[::1]:7400 (TLS)",
        "metrics": "off",
        "dashboard": "off (it is served with metrics)",
        "WebSocket": "wss://[::1]:7402/",
        "database": "postgresql://relay:***@db.example:5432/jobs (PostgreSQL)",
        "durability": "each ok after its COMMIT (PostgreSQL's)",
        "tokens": "3 (a client says hello with one)",
        "TLS": "on (jobs and WebSocket; metrics stay plain HTTP)",
    }
    assert "up to 10 s" in lines[-1] and "Ctrl-C" in lines[-1]
