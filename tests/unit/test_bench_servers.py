"""bench.servers.start_all: the servers of an A/B benchmark, each with its own environment and
log, alive together until the benchmark's stack closes."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from bench.servers import start_all


class FakeServer:
    """ServerProcess's constructor and context protocol, recorded instead of run."""

    events: list[tuple] = []

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path,
                 startup_timeout: float) -> None:
        self.args, self.env, self.log_path = args, env, log_path
        self.base_url = f"http://127.0.0.1:{30000 + len(FakeServer.events)}"
        FakeServer.events.append(("made", env["X"], str(log_path), startup_timeout))

    def __enter__(self) -> FakeServer:
        FakeServer.events.append(("up", self.env["X"]))
        return self

    def __exit__(self, *exc: object) -> None:
        FakeServer.events.append(("down", self.env["X"]))


def test_servers_start_in_order_and_stop_with_the_stack(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path, capsys) -> None:
    import sgl_ragged.testing as testing

    monkeypatch.setattr(testing, "ServerProcess", FakeServer)
    FakeServer.events = []
    runs = [("A", {"X": "a"}, tmp_path / "a.log"), ("B", {"X": "b"}, tmp_path / "b.log")]
    with contextlib.ExitStack() as stack:
        urls = start_all(stack, ["--model", "m"], runs, startup_timeout=60)
        assert FakeServer.events == [("made", "a", str(tmp_path / "a.log"), 60), ("up", "a"),
                                     ("made", "b", str(tmp_path / "b.log"), 60), ("up", "b")]
        assert urls == ["http://127.0.0.1:30000", "http://127.0.0.1:30002"]
    assert FakeServer.events[-2:] == [("down", "b"), ("down", "a")]
    out = capsys.readouterr().out
    assert "[1/2] A: starting the server" in out and "[2/2] B: starting the server" in out


def test_a_server_that_fails_to_start_stops_those_already_up(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    import sgl_ragged.testing as testing

    class Failing(FakeServer):
        def __enter__(self) -> FakeServer:
            if self.env["X"] == "b":
                raise RuntimeError("server b did not start")
            return super().__enter__()

    monkeypatch.setattr(testing, "ServerProcess", Failing)
    FakeServer.events = []
    runs = [("A", {"X": "a"}, tmp_path / "a.log"), ("B", {"X": "b"}, tmp_path / "b.log")]
    with pytest.raises(RuntimeError, match="did not start"), contextlib.ExitStack() as stack:
        start_all(stack, [], runs)
    assert FakeServer.events[-1] == ("down", "a")
