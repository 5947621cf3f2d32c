"""bench.triton_baseline: another revision's Triton kernels as a package of their own, run on
the same storage as today's (bench.decode_attention --baseline), and the table comparing them."""

from __future__ import annotations

import math
import random
import sys

import torch

from bench.decode_attention import markdown
from bench.triton_baseline import PACKAGE, export, load
from sgl_ragged.kernels.aot import split_plan
from sgl_ragged.kernels.batch import kernel_batch
from sgl_ragged.kernels.decode import decode_attention
from sgl_ragged.kernels.tables import layer_tables
from tests.unit.kernel_cases import Spec, random_plans, random_qkv, random_storage


def test_exported_kernels_import_as_their_own_package_and_agree(tmp_path, kernel_device,
                                                                monkeypatch):
    out = export("HEAD", tmp_path)
    source = (out / PACKAGE / "decode.py").read_text()
    assert "sgl_ragged.kernels" not in source and f"from {PACKAGE}.attend import" in source
    monkeypatch.setattr(sys, "path", list(sys.path))  # load() prepends out
    base = load(out)
    assert base["decode"].decode_attention is not decode_attention
    rng = random.Random(5)
    storage = random_storage(rng, kernel_device, precision="int4")
    plans = random_plans(storage, [Spec(4, 3, 1), Spec(1, 6, 1)], rng)
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(5), kernel_device)
    scale = 1 / math.sqrt(q.shape[-1])
    outs = []
    for kernels, tables, batch, plan in (
            (decode_attention, layer_tables, kernel_batch, split_plan),
            (base["decode"].decode_attention, base["tables"].layer_tables,
             base["batch"].kernel_batch, base["aot"].split_plan)):
        splits = plan([[0.5, 0.5]], 8, kernel_device).layer(0)
        out, _ = kernels(q, k, v, storage.stage_k[0], storage.stage_v[0], tables(storage, 0),
                         splits, batch(plans, kernel_device), scale)
        outs.append(out[:len(plans)])
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)


def test_load_refuses_a_directory_without_the_package(tmp_path):
    try:
        load(tmp_path)
    except SystemExit as e:
        assert "bench.triton_baseline" in str(e)
    else:
        raise AssertionError("load accepted a directory without kernels")


def test_table_compares_with_the_baseline():
    row = {"batch": 4, "context": 8192, "precision": "int4", "row_bytes_per_page": 65536,
           "aot_s": 0.002, "uniform_s": 0.003, "aot_gbps": 100.0, "uniform_gbps": 90.0,
           "baseline_aot_s": 0.004, "baseline_uniform_s": 0.003}
    table = markdown([row], 3000.0, "synthetic")
    assert "| 4 | 8192 | int4 | 2.000 | 4.000 | x0.50 | 3.000 | 3.000 | x1.00 |" in table
    del row["baseline_aot_s"], row["baseline_uniform_s"]
    assert "baseline" not in markdown([row], 3000.0, "synthetic")
