"""The lent-GPU scripts (scripts/gpu_*.sh) checked on the CPU: their bash syntax, and the
multi-turn table's plan (scripts/gpu_multiturn.sh with RAGGED_GPU_DRY_RUN=1: nothing installed,
no server); and how bench.multiturn carries on past a server that fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import multiturn, report
from bench.servers import GPU_ARGS, GPU_ENV
from sgl_ragged.testing.server import ServerError
from tests.unit.fake_deployments import fake_deployments

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("gpu_setup.sh", "gpu_serve.sh", "gpu_multiturn.sh", "gpu_check.sh", "gpu_wheels.sh",
           "gpu_issue21.sh", "gpu_pack_ab.sh", "device_replica.sh")


@pytest.mark.parametrize("name", SCRIPTS)
def test_bash_syntax(name: str) -> None:
    done = subprocess.run(["bash", "-n", str(ROOT / "scripts" / name)], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr


def _dry_run(script: str, model: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """`script` with RAGGED_GPU_DRY_RUN=1, its python3 this test's interpreter."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RAGGED_GPU_DRY_RUN": "1",
           "RAGGED_GPU_MODEL": str(model), "OUT": str(tmp_path / "out"), "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([str(ROOT / "scripts" / script)], env=env, capture_output=True,
                          text=True, timeout=600)


def test_gpu_multiturn_plan(llama_8b_shape: Path, tmp_path: Path) -> None:
    """The device command's four servers at equal bytes with the GPU settings, and a workload
    whose concurrent contexts alone outgrow both stock pools and fit the ragged ones."""
    done = _dry_run("gpu_multiturn.sh", llama_8b_shape, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["device"] == "cuda" and plan["env"] == GPU_ENV
    targets = {t["label"]: t for t in plan["targets"]}
    assert list(targets) == ["baseline", "ragged@int4:uniform:0.3", "baseline@fp8_e4m3",
                             "ragged:uniform:0.3"]
    tokens = {label: t["budget"]["kv_tokens"] for label, t in targets.items()}
    assert tokens["baseline"] == 16384 and tokens["baseline@fp8_e4m3"] == 32768
    assert 2.5 * 16384 < tokens["ragged:uniform:0.3"] < tokens["ragged@int4:uniform:0.3"]
    for t in plan["targets"]:
        args = t["launch_args"]
        assert args[args.index("--max-total-tokens") + 1] == str(t["budget"]["kv_tokens"])
        assert " ".join(GPU_ARGS) in " ".join(args) and "--sleep-on-idle" not in args
    assert targets["baseline"]["launch_args"][-2:] == ["--attention-backend", "triton"]
    assert targets["baseline@fp8_e4m3"]["launch_args"][-2:] == ["--kv-cache-dtype", "fp8_e4m3"]
    live = plan["concurrent_context_tokens"]  # a lower bound of the live histories
    assert tokens["baseline@fp8_e4m3"] < live < 0.8 * tokens["ragged@int4:uniform:0.3"]
    assert (tmp_path / "out" / "multiturn.txt").read_text().strip().endswith("}")
    # the four servers start at once and are measured one after the other
    assert "--start-together" in (ROOT / "scripts" / "gpu_multiturn.sh").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU bench.gpu_serve starts servers")
def test_gpu_serve_dry_run_reaches_the_bench(llama_8b_shape: Path, tmp_path: Path) -> None:
    done = _dry_run("gpu_serve.sh", llama_8b_shape, tmp_path)
    assert done.returncode == 0 and "needs a CUDA device" in done.stdout, done.stderr[-3000:]


def test_multiturn_records_a_failed_server_and_goes_on(llama_8b_shape: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing:
        def __init__(self, target, server_args, env, log) -> None:
            self.env = env

        def __enter__(self):
            assert self.env == GPU_ENV
            raise ServerError("server exited with code 1\nlog tail")

        def __exit__(self, *exc) -> None:
            pass

    monkeypatch.setattr(multiturn, "_deployment", Failing)
    args = multiturn.parse_args(["--device", "cuda", "--model", str(llama_8b_shape), "--launch",
                                 "baseline", "--launch", "baseline@fp8_e4m3", "--out",
                                 str(tmp_path)])
    saved: list[int] = []
    done = multiturn.run_launched(args, str(llama_8b_shape), [], [multiturn.LoadConfig()],
                                  lambda so_far: saved.append(len(so_far.failed)))
    assert done.runs == [] and saved == [1, 2]
    assert [f["label"] for f in done.failed] == ["baseline", "baseline@fp8_e4m3"]
    assert "--kv-cache-dtype" in done.failed[1]["launch_args"]
    result = report.build(done.runs, done.failed, workload={}, argv=[])
    table = report.write(result, tmp_path, plots=False)
    assert "**baseline@fp8_e4m3 failed**: ServerError: server exited with code 1" in table
    assert json.loads((tmp_path / "multiturn.json").read_text())["failed"][0]["label"] == "baseline"


def _together_args(model: Path, tmp_path: Path, *labels: str) -> Any:
    argv = ["--device", "cuda", "--model", str(model), "--start-together", "--out", str(tmp_path)]
    for label in labels:
        argv += ["--launch", label]
    return multiturn.parse_args(argv)


def test_start_together_starts_all_then_measures_one_at_a_time(
        llama_8b_shape: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--start-together: every server is up before the first run (their starts overlap: a
    barrier all three must reach), each is measured alone in launch order and stopped right
    after its runs; one that fails beside the others starts again alone after them."""
    import threading

    events: list[tuple[str, str]] = []
    barrier = threading.Barrier(3, timeout=20)

    def refuse(label: str, attempt: int) -> None:
        if attempt == 1:
            barrier.wait()  # all three start at once, or this times out
            if label == "ragged:uniform:0.3":
                raise ServerError("out of memory beside the others")

    Fake, attempts = fake_deployments(events, refuse)

    def run_one(base_url, label, sessions, load, flush=True):
        events.append(("run", label))
        return {"label": label}

    monkeypatch.setattr(multiturn, "_deployment", Fake)
    monkeypatch.setattr(multiturn, "run_one", run_one)
    args = _together_args(llama_8b_shape, tmp_path, "baseline", "ragged:uniform:0.3",
                          "baseline@fp8_e4m3")
    saved: list[int] = []
    done = multiturn.run_launched(args, str(llama_8b_shape), [], [multiturn.LoadConfig()],
                                  lambda so_far: saved.append(len(so_far.runs)))
    assert [r["label"] for r in done.runs] == ["baseline", "baseline@fp8_e4m3",
                                               "ragged:uniform:0.3"]
    assert done.failed == [] and saved == [1, 2, 3]
    assert sorted(events[:2]) == [("up", "baseline"), ("up", "baseline@fp8_e4m3")]
    assert events[2:] == [("run", "baseline"), ("down", "baseline"),
                          ("run", "baseline@fp8_e4m3"), ("down", "baseline@fp8_e4m3"),
                          ("up", "ragged:uniform:0.3"), ("run", "ragged:uniform:0.3"),
                          ("down", "ragged:uniform:0.3")]
    assert attempts == {"baseline": 1, "baseline@fp8_e4m3": 1, "ragged:uniform:0.3": 2}


def test_start_together_stops_every_server_when_cut_short(
        llama_8b_shape: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupted run (a device call's timeout) leaves no server of those started together
    running: the one measured and the ones still waiting are all stopped."""
    events: list[tuple[str, str]] = []
    Fake, _ = fake_deployments(events)

    def run_one(base_url, label, sessions, load, flush=True):
        raise KeyboardInterrupt

    monkeypatch.setattr(multiturn, "_deployment", Fake)
    monkeypatch.setattr(multiturn, "run_one", run_one)
    args = _together_args(llama_8b_shape, tmp_path, "baseline", "baseline@fp8_e4m3")
    with pytest.raises(KeyboardInterrupt):
        multiturn.run_launched(args, str(llama_8b_shape), [], [multiturn.LoadConfig()],
                               lambda so_far: None)
    assert sorted(e for e in events if e[0] == "down") == [("down", "baseline"),
                                                           ("down", "baseline@fp8_e4m3")]


def test_issue21_call_fits_one_device_call(tmp_path: Path) -> None:
    """scripts/gpu_issue21.sh's phases (RAGGED_GPU_DRY_RUN=1: their boxes, nothing run): in the
    issue's order, inside one call's 600 s with time left to pack the results, the fixed boxes
    leaving the benchmarks at least a minute, and the kernel tests those of gpu_check.sh."""
    env = {**os.environ, "RAGGED_GPU_DRY_RUN": "1", "RAGGED_GPU_WORK": str(tmp_path / "work")}
    done = subprocess.run([str(ROOT / "scripts" / "gpu_issue21.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    phases = [line.split(":")[0] for line in lines]
    assert phases == ["pv", "tests", "serve", "bench", "planes"]
    boxes = {p: int(line.split("box ")[1].split(" s")[0]) for p, line in zip(phases, lines, strict=True)
             if "box " in line}
    script = (ROOT / "scripts" / "gpu_issue21.sh").read_text()
    budget = int(script.split("RAGGED_GPU_BUDGET_S:-")[1].split("}")[0])
    assert budget <= 600 - 30 and sum(boxes.values()) == budget
    assert boxes["bench"] >= 60
    tests_line = lines[phases.index("tests")]
    named = {w for w in tests_line.split() if w.startswith("tests/")}
    check = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert named == {w for w in check.split() if w.startswith("tests/unit/test_")}
    assert all((ROOT / name).is_file() for name in named)
    assert "gpu_serve.sh --layers 8 --precision int4" in lines[phases.index("serve")]


def test_pack_ab_times_both_kernels_in_one_run(tmp_path: Path) -> None:
    """scripts/gpu_pack_ab.sh (RAGGED_GPU_DRY_RUN=1): one bench.decode_breakdown run of int4
    rows with packing off and on whose options parse (arguments replace its cases), then one
    of the pipelined launches beside the shipped ones, then the kernel tests with packed pages
    on."""
    from bench import decode_breakdown as bd
    from sgl_ragged.kernels.decode import DECODE_LAUNCH

    def plan(*args: str) -> dict[str, list[str]]:
        env = {**os.environ, "RAGGED_GPU_DRY_RUN": "1", "OUT": str(tmp_path)}
        done = subprocess.run([str(ROOT / "scripts" / "gpu_pack_ab.sh"), *args], env=env,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return {line.split(":")[0]: line.split(": ", 1)[1].split()
                for line in done.stdout.strip().splitlines()}

    steps = plan()
    assert list(steps) == ["bench", "stages", "tests"]  # the A/B first: a timeout cuts the tests
    assert steps["tests"][0] == "RAGGED_TRITON_PACK=1"
    assert "tests/unit/test_kernels_attention.py" in steps["tests"]
    bench = steps["bench"]
    assert bench[:3] == ["python3", "-m", "bench.decode_breakdown"]
    args = bd.argument_parser().parse_args(bench[3:])
    variants = bd.variants_of(args)
    assert args.precision == "int4" and variants.pack == (False, True)
    assert variants.launches("int4", pack=True) == [DECODE_LAUNCH["packed"]]
    assert variants.launches("int4") == [DECODE_LAUNCH["codes"]]
    assert bd.cases(args.batch, args.context) == [(16, 8192), (16, 65536), (64, 8192),
                                                   (64, 65536)]
    # Software pipelining beside the shipped launches, unpacked and packed, at one case.
    args = bd.argument_parser().parse_args(steps["stages"][3:])
    variants = bd.variants_of(args)
    assert variants.pack == (False, True) and bd.cases(args.batch, args.context) == [(16, 65536)]
    assert variants.launches("int4") == [DECODE_LAUNCH["codes"], (1, 32, 2), (2, 32, 2)]
    assert variants.launches("int4", pack=True) == [DECODE_LAUNCH["packed"], (1, 32, 2),
                                                    (2, 32, 2)]
    assert args.out != bd.argument_parser().parse_args(bench[3:]).out  # its own table
    args = bd.argument_parser().parse_args(plan("--batch", "4", "--context", "8192")["bench"][3:])
    assert bd.cases(args.batch, args.context) == [(4, 8192)]
