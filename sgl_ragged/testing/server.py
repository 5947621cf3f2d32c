"""Start a real ``sglang.launch_server`` in its own process group and wait until it serves.

Typical use (tests, benchmarks)::

    with ServerProcess(["--model-path", model, "--device", "cpu"]) as server:
        requests.post(f"{server.base_url}/generate", json=...)

The server runs on 127.0.0.1 and a free port, with ``SGLANG_USE_CPU_ENGINE=1``; its
output goes to a log file. On exit every process of the group (SGLang spawns a
scheduler and a detokenizer) is terminated, then killed if it lingers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import psutil

HOST = "127.0.0.1"
# What a server logs when a port it picked was taken: uvicorn's (SGLang's HTTP port), the
# Rust std's (the router, its Prometheus port too), and torch's TCPStore (SGLang's
# distributed-init port, a free port it picks itself at launch: servers started together can
# pick the same one, session 45's CI lost a server to it).
BIND_ERRORS = ("error while attempting to bind on address", "Address already in use (os error 98)",
               "name: EADDRINUSE, message: address already in use")
BIND_RETRIES = 3
# A start waits while the machine has less memory available than this (GB; unset or 0: never),
# at most MEMORY_WAIT_S seconds, then starts anyway. scripts/test.sh sets it for its parallel
# shards: session 53's CI, whose servers start twice as fast, had one shard's data-parallel and
# router servers up beside the other's four precision servers, 22.5 of 24 GB used.
MIN_AVAILABLE_ENV = "RAGGED_SERVER_MIN_AVAILABLE_GB"
MEMORY_WAIT_S = 600.0


class ServerError(RuntimeError):
    """The server died or did not become healthy in time; the message carries the log tail."""


class PortTakenError(ServerError):
    """The chosen port was taken before the server could bind it (the server hangs on)."""


def free_port(host: str = HOST) -> int:
    """Return a TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _http_status(url: str, timeout: float) -> int | None:
    """HTTP status of a GET of ``url``, or None if nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def wait_for_memory(min_gb: float, name: str, max_wait_s: float = MEMORY_WAIT_S,
                    poll_s: float = 5.0) -> float:
    """Block while less than `min_gb` GB is available (MIN_AVAILABLE_ENV), at most `max_wait_s`
    seconds; return the seconds waited. Says on stderr when it waits and when it gives up."""
    t0 = time.monotonic()
    announced = False
    while min_gb > 0 and (available := psutil.virtual_memory().available / 2**30) < min_gb:
        waited = time.monotonic() - t0
        if waited >= max_wait_s:
            print(f"[server] {name}: starting after {waited:.0f} s with {available:.1f} GB "
                  f"available (wanted {min_gb:g})", file=sys.stderr, flush=True)
            break
        if not announced:
            print(f"[server] {name}: waiting for {min_gb:g} GB of memory ({available:.1f} GB "
                  f"available)", file=sys.stderr, flush=True)
            announced = True
        time.sleep(poll_s)
    return time.monotonic() - t0


def _on_cpu(args: Sequence[str]) -> bool:
    """``--device cpu`` (or ``--device=cpu``) among launch_server arguments."""
    pairs = zip(args, args[1:], strict=False)  # each argument with the next one
    return "--device=cpu" in args or any(a == "--device" and b == "cpu" for a, b in pairs)


class ServerProcess:
    """A ``python -m sglang.launch_server`` child process, usable as a context manager.

    ``args`` are passed to ``launch_server`` as given; ``--host`` and ``--port`` are added
    (do not pass them), and ``--sleep-on-idle`` for ``--device cpu``: an idle SGLang scheduler
    otherwise busy-polls a whole core, which starves every other server and test on a small CPU.
    ``env`` entries override the inherited environment. ``module`` runs another entry point
    with the same handling, e.g. ``sglang_router.launch_router`` (testing/router.py).
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        startup_timeout: float = 600.0,
        python: str = sys.executable,
        module: str = "sglang.launch_server",
    ) -> None:
        self.args = list(args)
        if _on_cpu(self.args) and "--sleep-on-idle" not in self.args:
            self.args.append("--sleep-on-idle")
        self.port = port if port is not None else free_port()
        self._fixed_port = port is not None
        self.extra_env = dict(env or {})
        self.log_path = log_path or self._default_log_path()
        self.startup_timeout = startup_timeout
        self.python = python
        self.module = module  # e.g. "sglang_router.launch_router" (testing/router.py)
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{HOST}:{self.port}"

    @property
    def command(self) -> list[str]:
        """The full command line that is (or will be) run."""
        return [
            self.python,
            "-m",
            self.module,
            *self.args,
            "--host",
            HOST,
            "--port",
            str(self.port),
        ]

    def _default_log_path(self) -> Path:
        fd, name = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
        os.close(fd)
        return Path(name)

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env.update(self.extra_env)
        return env

    def start(self) -> ServerProcess:
        """Launch the server and block until it is healthy; raise ServerError otherwise. A port
        taken between free_port() and the server's bind (another server's internal sockets pick
        ports too) is retried on a new free port, up to BIND_RETRIES times."""
        for attempt in range(BIND_RETRIES + 1):
            try:
                return self._start_once()
            except PortTakenError:
                if attempt == BIND_RETRIES or self._fixed_port:
                    raise
                self.proc = None
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self) -> ServerProcess:
        if self.proc is not None:
            raise RuntimeError("ServerProcess.start() called twice")
        wait_for_memory(float(os.environ.get(MIN_AVAILABLE_ENV) or 0), self.log_path.name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(),
                start_new_session=True,
            )
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, t0: float) -> None:
        """Poll the health endpoints until one answers, the process dies, or time runs out."""
        assert self.proc is not None
        while True:
            log = self.log_text()
            if any(e in log for e in BIND_ERRORS):
                raise PortTakenError(self._failure(f"port {self.port} was taken before the server bound it"))
            if self.proc.poll() is not None:
                raise ServerError(self._failure(f"server exited with code {self.proc.returncode}"))
            if self._healthy():
                return
            if time.monotonic() - t0 > self.startup_timeout:
                raise ServerError(
                    self._failure(f"server not healthy after {self.startup_timeout:.0f} s")
                )
            time.sleep(1.0)

    def _healthy(self) -> bool:
        """``/health_generate`` answers 200 (runs one token); ``/health`` if it does not exist."""
        status = _http_status(self.base_url + "/health_generate", timeout=60.0)
        if status == 404:
            status = _http_status(self.base_url + "/health", timeout=30.0)
        return status == 200

    def _failure(self, what: str) -> str:
        return (
            f"{what}\ncommand: {' '.join(self.command)}\nlog: {self.log_path}\n"
            f"--- last lines of the log ---\n{self.log_tail()}"
        )

    def log_text(self) -> str:
        """Everything the server has written to its log so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def stop(self, grace: float = 20.0) -> None:
        """Stop the server and every process it spawned; no orphans are left behind.

        SIGTERM goes to the launcher first (SGLang then shuts its children down itself;
        signalling them too makes it report a crash and linger); whatever is still alive
        after ``grace`` seconds, in the process group or the process tree, gets SIGKILL.
        """
        if self.proc is None:
            return
        procs = self._tree()
        _send(procs[:1], signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=grace)
        self._signal_group(signal.SIGKILL)
        _send(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5.0)
        self.proc.wait(timeout=5.0)

    def _tree(self) -> list[psutil.Process]:
        """The server process and all its descendants (some may have left the group)."""
        assert self.proc is not None
        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _send(procs: list[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
