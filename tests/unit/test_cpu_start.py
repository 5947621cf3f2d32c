"""compat/cpu_start.py: with RAGGED_CPU_START_METHOD=fork a CPU server's launcher forks its
children; everything else, and the default, spawns.

`start_method` is checked for each condition on its own; `launch_processes` in a fresh
interpreter (one thread, as a launcher) really forks a child that sees the parent's state and
spawns again itself, and puts the parent's previous method back. The servers of the test suite
start by fork (tests/conftest.py; tests/e2e/test_serving.py checks the launcher's log)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import types

import pytest

from sgl_ragged.compat import cpu_start


@pytest.fixture
def launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as `python -m sglang.launch_server` with no other Python thread, forking
    asked for."""
    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="sglang.launch_server")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setenv(cpu_start.ENV, "fork")
    monkeypatch.delenv(cpu_start.NUMA_ENV, raising=False)


def test_a_cpu_launcher_forks(launcher: None) -> None:
    assert cpu_start.start_method("cpu")[0] == "fork"


@pytest.mark.parametrize("case", ["cuda", "default", "env", "numa", "memory-saver", "engine", "threads",
                                  "sglang-run"])
def test_everything_else_spawns(launcher: None, monkeypatch: pytest.MonkeyPatch, case: str
                                ) -> None:
    device, saver = "cpu", False
    if case == "cuda":
        device = "cuda"
    elif case == "default":
        monkeypatch.delenv(cpu_start.ENV)
    elif case == "env":
        monkeypatch.setenv(cpu_start.ENV, "spawn")
    elif case == "numa":
        monkeypatch.setenv(cpu_start.NUMA_ENV, "1")
    elif case == "memory-saver":
        saver = True
    elif case == "engine":  # a user's script that builds sglang.Engine
        monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
        monkeypatch.setattr(sys, "argv", ["my_script.py"])
    elif case == "threads":
        monkeypatch.setattr(threading, "active_count", lambda: 2)
    elif case == "sglang-run":  # the sglang CLI, but not its serve command
        monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
        monkeypatch.setattr(sys, "argv", ["/venv/bin/sglang", "version"])
    method, why = cpu_start.start_method(device, saver)
    assert method == "spawn" and why


def test_sglang_serve_is_a_launcher(launcher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    monkeypatch.setattr(sys, "argv", ["/venv/bin/sglang", "serve", "--model-path", "m"])
    assert cpu_start.start_method("cpu")[0] == "fork"


def test_a_bad_choice_is_refused(launcher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_start.ENV, "forkserver")
    with pytest.raises(ValueError, match="RAGGED_CPU_START_METHOD=forkserver is not a choice"):
        cpu_start.start_method("cpu")


CHILD = textwrap.dedent("""
    import json, multiprocessing, sys, types
    from sgl_ragged.compat import cpu_start

    MARK = {"set after import": None}
    cpu_start.is_server_launcher = lambda: True

    def report(queue):
        queue.put({"mark": MARK["set after import"], "own": multiprocessing.get_start_method()})

    def launch(cls, server_args):  # stands for Engine._launch_scheduler_processes
        queue = multiprocessing.SimpleQueue()
        child = multiprocessing.Process(target=report, args=(queue,))
        child.start()
        child.join(60)
        return {"method": multiprocessing.get_start_method(), "child": queue.get(),
                "exitcode": child.exitcode}

    if __name__ == "__main__":
        multiprocessing.set_start_method("spawn", force=True)  # as SGLang's launcher sets it
        MARK["set after import"] = "parent"
        args = types.SimpleNamespace(device=sys.argv[1], enable_memory_saver=False)
        result = cpu_start.launch_processes(launch, object, args)
        result["after"] = multiprocessing.get_start_method()
        print("RESULT " + json.dumps(result))
""")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_launch_processes_forks_and_puts_spawn_back(tmp_path, monkeypatch, device) -> None:
    monkeypatch.setenv(cpu_start.ENV, "fork")
    script = tmp_path / "launcher.py"
    script.write_text(CHILD)
    done = subprocess.run([sys.executable, str(script), device], capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    forked = device == "cpu"
    assert result["method"] == ("fork" if forked else "spawn")
    assert result["exitcode"] == 0
    # A forked child has the parent's state and spawns what it starts; a spawned one
    # imported the module afresh.
    assert result["child"] == {"mark": "parent" if forked else None, "own": "spawn"}
    assert result["after"] == "spawn"
