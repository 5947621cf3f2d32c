"""ServerProcess's command line (no server is started)."""

from __future__ import annotations

import pytest

from sgl_ragged.testing import server as server_mod
from sgl_ragged.testing.server import BIND_ERRORS, ServerProcess


def test_cpu_servers_sleep_when_idle():
    cmd = ServerProcess(["--model-path", "m", "--device", "cpu"], port=1).command
    assert cmd.count("--sleep-on-idle") == 1
    given = ServerProcess(["--device=cpu", "--sleep-on-idle"], port=1).command
    assert given.count("--sleep-on-idle") == 1


def test_other_devices_are_left_alone():
    assert "--sleep-on-idle" not in ServerProcess(["--device", "cuda"], port=1).command
    assert "--sleep-on-idle" not in ServerProcess(["--model-path", "cpu"], port=1).command


FAKE_SERVER = '''
import http.server, sys, time
from pathlib import Path

port = int(sys.argv[sys.argv.index("--port") + 1])
marker = Path(sys.argv[sys.argv.index("--marker") + 1])
message = sys.argv[sys.argv.index("--message") + 1]
if not marker.exists():  # first start: the port "was taken"; hang on like uvicorn does
    marker.write_text(str(port))
    print(f"ERROR:    {message}", flush=True)
    time.sleep(600)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()


http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
'''


@pytest.mark.parametrize("message", BIND_ERRORS)  # SGLang's uvicorn, the router
def test_a_port_taken_before_the_bind_is_retried_on_another(tmp_path, monkeypatch, message):
    """The first launch reports a taken port and hangs: start() stops it and relaunches on a
    new free port, which answers."""
    # A fake server needs no memory: not scripts/test.sh's wait for it (247 s in session
    # 53's CI, while the end-to-end shards' servers held the memory).
    monkeypatch.delenv(server_mod.MIN_AVAILABLE_ENV, raising=False)
    (tmp_path / "fake_server.py").write_text(FAKE_SERVER)
    marker = tmp_path / "first-port"
    server = ServerProcess(["--marker", str(marker), "--message", message], module="fake_server",
                           env={"PYTHONPATH": str(tmp_path)}, log_path=tmp_path / "log",
                           startup_timeout=60)
    first = server.port
    with server:
        assert int(marker.read_text()) == first
        assert server.port != first and server.proc.poll() is None


class _Memory:
    """psutil.virtual_memory() stand-in: the available bytes in turn, the last one after."""

    def __init__(self, *available_gb: float) -> None:
        self.left = [gb * 2**30 for gb in available_gb]

    def __call__(self):
        value = self.left.pop(0) if len(self.left) > 1 else self.left[0]
        return type("Mem", (), {"available": value})()


def _fake_clock(monkeypatch) -> list[float]:
    now = [0.0]
    monkeypatch.setattr(server_mod.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(server_mod.time, "sleep", lambda s: now.__setitem__(0, now[0] + s))
    return now


def test_a_start_waits_until_memory_is_available(monkeypatch, capsys):
    _fake_clock(monkeypatch)
    monkeypatch.setattr(server_mod.psutil, "virtual_memory", _Memory(2.0, 3.0, 7.0))
    assert server_mod.wait_for_memory(6.0, "s.log", poll_s=5.0) == 10.0
    assert "s.log: waiting for 6 GB of memory (2.0 GB available)" in capsys.readouterr().err


def test_a_start_goes_ahead_after_the_longest_wait(monkeypatch, capsys):
    _fake_clock(monkeypatch)
    monkeypatch.setattr(server_mod.psutil, "virtual_memory", _Memory(1.0))
    assert server_mod.wait_for_memory(6.0, "s.log", max_wait_s=60.0, poll_s=5.0) == 60.0
    assert "s.log: starting after 60 s with 1.0 GB available (wanted 6)" in capsys.readouterr().err


def test_no_threshold_never_waits(monkeypatch):
    _fake_clock(monkeypatch)
    monkeypatch.setattr(server_mod.psutil, "virtual_memory", _Memory(0.1))
    assert server_mod.wait_for_memory(0.0, "s.log") == 0.0
