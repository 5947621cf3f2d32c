"""ServerProcess's command line (no server is started)."""

from __future__ import annotations

from sgl_ragged.testing.server import ServerProcess


def test_cpu_servers_sleep_when_idle():
    cmd = ServerProcess(["--model-path", "m", "--device", "cpu"], port=1).command
    assert cmd.count("--sleep-on-idle") == 1
    given = ServerProcess(["--device=cpu", "--sleep-on-idle"], port=1).command
    assert given.count("--sleep-on-idle") == 1


def test_other_devices_are_left_alone():
    assert "--sleep-on-idle" not in ServerProcess(["--device", "cuda"], port=1).command
    assert "--sleep-on-idle" not in ServerProcess(["--model-path", "cpu"], port=1).command
