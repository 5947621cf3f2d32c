"""The pure-torch sgl_kernel stand-in: each op against plain torch, and its installation."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sgl_ragged.compat import import_hook
from sgl_ragged.compat import sgl_kernel_cpu as sk

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOL[actual.dtype]
    torch.testing.assert_close(actual, expected.to(actual.dtype), rtol=tol, atol=tol)


# --- norms ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm_matches_torch(dtype: torch.dtype, gemma: bool) -> None:
    x, w = _randn(7, 96, dtype=dtype, seed=0), _randn(96, dtype=dtype, seed=1)
    op = sk.gemma_rmsnorm if gemma else sk.rmsnorm
    scale = w.float() + 1 if gemma else w.float()
    expected = F.rms_norm(x.float(), (96,), scale, eps=1e-6)
    got = op(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    _close(got, expected)
    out = torch.empty_like(x)
    assert op(x, w, 1e-6, out=out) is out
    _close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm_updates_both_in_place(dtype: torch.dtype, gemma: bool) -> None:
    x, r = _randn(5, 64, dtype=dtype, seed=2), _randn(5, 64, dtype=dtype, seed=3)
    w = _randn(64, dtype=dtype, seed=4)
    total = x.float() + r.float()
    scale = w.float() + 1 if gemma else w.float()
    expected = F.rms_norm(total, (64,), scale, eps=1e-5)
    op = sk.gemma_fused_add_rmsnorm if gemma else sk.fused_add_rmsnorm
    assert op(x, r, w, 1e-5) is None
    _close(r, total)
    _close(x, expected)


# --- gated activations ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("name", "act"),
    [
        ("silu_and_mul", F.silu),
        ("gelu_and_mul", F.gelu),
        ("gelu_tanh_and_mul", lambda t: F.gelu(t, approximate="tanh")),
    ],
)
def test_act_and_mul_matches_torch(dtype: torch.dtype, name: str, act) -> None:
    x = _randn(3, 4, 2 * 48, dtype=dtype, seed=5)
    gate, up = x.float().chunk(2, dim=-1)
    expected = act(gate) * up
    got = getattr(sk, name)(x)
    assert got.shape == (3, 4, 48) and got.dtype == dtype
    _close(got, expected)
    out = torch.empty(3, 4, 48, dtype=dtype)
    assert getattr(sk, name)(x, out) is out
    _close(out, expected)


def test_act_and_mul_rejects_wrong_out_shape() -> None:
    with pytest.raises(ValueError, match="expected"):
        sk.silu_and_mul(torch.zeros(2, 8), torch.zeros(2, 8))


# --- copy_all_layer_kv_cache_cpu --------------------------------------------------------


def _kv_buffers(num_layers: int, slots: int, seed: int) -> list[torch.Tensor]:
    """K then V buffers laid out like MHATokenToKVPool: [slots, heads, head_dim] each."""
    k = [_randn(slots, 3, 16, dtype=torch.bfloat16, seed=seed + i) for i in range(num_layers)]
    v = [_randn(slots, 3, 8, dtype=torch.float16, seed=seed + 99 + i) for i in range(num_layers)]
    return k + v


def _ptrs_and_strides(bufs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.dtype.itemsize for b in bufs], dtype=torch.int64)
    return ptrs, strides


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_copy_all_layer_kv_cache_matches_gather_scatter(
    seed: int, index_dtype: torch.dtype
) -> None:
    bufs = _kv_buffers(num_layers=4, slots=50, seed=seed)
    expected = [b.clone() for b in bufs]
    perm = torch.randperm(50, generator=_gen(seed))
    src, tgt = perm[:20], perm[10:30]  # overlapping: some targets are also sources
    for b in expected:
        b[tgt] = b[src].clone()
    ptrs, strides = _ptrs_and_strides(bufs)
    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt.to(index_dtype), src.to(index_dtype))
    for got, want in zip(bufs, expected, strict=True):
        assert torch.equal(got, want)


def test_copy_all_layer_kv_cache_swaps_rows() -> None:
    buf = torch.arange(12, dtype=torch.float32).view(4, 3)
    ptrs, strides = _ptrs_and_strides([buf])
    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([1, 2]), torch.tensor([2, 1]))
    assert buf[1].tolist() == [6.0, 7.0, 8.0] and buf[2].tolist() == [3.0, 4.0, 5.0]


def test_copy_all_layer_kv_cache_empty_is_noop() -> None:
    buf = torch.ones(4, 2)
    ptrs, strides = _ptrs_and_strides([buf])
    empty = torch.empty(0, dtype=torch.int64)
    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, empty, empty)
    assert torch.equal(buf, torch.ones(4, 2))


# --- assign_req_to_token_pool_cpu -------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("offset_dtype", [torch.int64, torch.int32])
def test_assign_req_to_token_pool_matches_loop(seed: int, offset_dtype: torch.dtype) -> None:
    g, pool_len, bs = _gen(seed), 40, 5
    req_to_token = torch.randint(0, 1000, (8, pool_len), generator=g, dtype=torch.int32)
    rpi = torch.randperm(8, generator=g)[:bs]
    start = torch.randint(0, 20, (bs,), generator=g)
    end = start + torch.randint(0, 20, (bs,), generator=g)  # some requests get 0 tokens
    out_cache_loc = torch.randint(0, 10_000, (int((end - start).sum()),), generator=g)
    expected, pos = req_to_token.clone(), 0
    for i in range(bs):
        n = int(end[i] - start[i])
        expected[rpi[i], start[i] : end[i]] = out_cache_loc[pos : pos + n].to(torch.int32)
        pos += n
    sk.assign_req_to_token_pool_cpu(
        rpi, req_to_token, start.to(offset_dtype), end.to(offset_dtype), out_cache_loc, pool_len
    )
    assert torch.equal(req_to_token, expected)


def test_assign_req_to_token_pool_checks_dtypes() -> None:
    with pytest.raises(TypeError):
        sk.assign_req_to_token_pool_cpu(
            torch.zeros(1, dtype=torch.int64),
            torch.zeros(1, 4, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int64),
            4,
        )


# --- installation -----------------------------------------------------------------------


def _sgl_kernel_keys() -> list[str]:
    return [m for m in sys.modules if m == "sgl_kernel" or m.startswith("sgl_kernel.")]


@pytest.fixture
def no_sgl_kernel(monkeypatch: pytest.MonkeyPatch):
    """sys.modules without any sgl_kernel entry; the original entries come back afterwards."""
    for name in _sgl_kernel_keys():
        monkeypatch.delitem(sys.modules, name)
    yield monkeypatch
    for name in _sgl_kernel_keys():
        del sys.modules[name]


@pytest.fixture
def real_import_fails(no_sgl_kernel: pytest.MonkeyPatch) -> None:
    """Make ``import sgl_kernel`` raise ImportError, as on a machine without CUDA."""
    no_sgl_kernel.setitem(sys.modules, "sgl_kernel", None)


def test_import_of_module_patches_nothing() -> None:
    code = (
        "import sys, sgl_ragged.compat.sgl_kernel_cpu as m; "
        "assert not any(k.startswith('sgl_kernel') for k in sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_install_when_real_import_fails(real_import_fails: None) -> None:
    assert sk.install_if_needed() is True
    import sgl_kernel

    assert getattr(sgl_kernel, sk.STANDIN_FLAG)
    assert sgl_kernel.rmsnorm is sk.rmsnorm
    assert sys.modules["sgl_kernel.kvcacheio"].copy_all_layer_kv_cache_cpu is (
        sk.copy_all_layer_kv_cache_cpu
    )


def test_install_is_idempotent(real_import_fails: None) -> None:
    assert sk.install_if_needed() is True
    first = sys.modules["sgl_kernel"]
    assert sk.install_if_needed() is True
    assert sys.modules["sgl_kernel"] is first
    assert sk.is_standin_installed()


def test_noop_when_real_import_succeeds(no_sgl_kernel: pytest.MonkeyPatch) -> None:
    real = types.ModuleType("sgl_kernel")
    no_sgl_kernel.setitem(sys.modules, "sgl_kernel", real)
    assert sk.install_if_needed() is False
    assert sys.modules["sgl_kernel"] is real
    assert not sk.is_standin_installed()


def test_names_sglang_imports_on_cpu(real_import_fails: None) -> None:
    sk.install_if_needed()
    from sgl_kernel import (  # noqa: F401
        assign_draft_cache_locs_contiguous_cpu,
        assign_extend_cache_locs_cpu,
        assign_req_to_token_pool_cpu,
        build_tree_kernel_efficient_cpu,
        copy_all_layer_kv_cache_cpu,
        fill_accept_out_cache_loc_cpu,
        fill_bonus_tokens_cpu,
        fused_add_rmsnorm,
        gemma_fused_add_rmsnorm,
        gemma_rmsnorm,
        rmsnorm,
        rotate_input_ids_cpu,
        verify_tree_greedy_cpu,
    )
    from sgl_kernel.mamba import (  # noqa: F401
        causal_conv1d_fn_cpu,
        causal_conv1d_update_cpu,
        chunk_gated_delta_rule_cpu,
    )


def test_launch_helpers_of_the_cuda_path(real_import_fails: None) -> None:
    sk.install_if_needed()
    from sgl_kernel import weak_ref_tensor
    from sgl_kernel.utils import is_arch_support_pdl

    x = torch.zeros(3)
    assert is_arch_support_pdl() is False and weak_ref_tensor(x) is x


# The modules a dense Llama's CUDA path imports at start (SGLang 0.5.23), and the server's
# entry point: each imports sgl_kernel names at module level under `if _is_cuda`.
CUDA_PATH_MODULES = (
    "sglang.srt.layers.layernorm", "sglang.srt.layers.activation", "sglang.srt.layers.sampler",
    "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.quantization.gguf",
    "sglang.srt.layers.quantization.w8a8_int8", "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor", "sglang.srt.models.llama",
    "sglang.srt.model_executor.model_runner", "sglang.launch_server",
)


def test_cuda_path_imports_with_the_standin() -> None:
    """On a GPU machine without the sgl-kernel wheel (scripts/gpu_serve.sh), SGLang's CUDA path
    imports every name it needs from the stand-in: checked here with torch reporting a CUDA
    device, in a fresh process."""
    pytest.importorskip("sglang")
    code = (
        "import importlib, sys, torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "torch.version.cuda = '13.0'\n"
        "torch.cuda.get_device_capability = lambda *a, **k: (9, 0)\n"
        "torch.cuda.get_device_name = lambda *a, **k: 'NVIDIA H200'\n"
        "torch.cuda.device_count = lambda: 1\n"
        "torch.cuda.current_device = lambda: 0\n"
        "from sgl_ragged.compat import sgl_kernel_cpu as sk\n"
        "sk.install_if_needed()\n"
        "assert sk.is_standin_installed()\n"
        f"for name in {CUDA_PATH_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "from sglang.srt.utils.common import is_cuda\n"
        "assert is_cuda(), 'the CUDA path was not taken'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_absent_names_raise_import_error(real_import_fails: None) -> None:
    sk.install_if_needed()
    with pytest.raises(ImportError):
        from sgl_kernel import fused_experts_cpu  # noqa: F401
    with pytest.raises(ImportError):
        import sgl_kernel.scalar_type  # noqa: F401


@pytest.mark.parametrize("sub", sorted(sk.STUBBED))
def test_stubs_raise_not_implemented_naming_the_op(real_import_fails: None, sub: str) -> None:
    sk.install_if_needed()
    for name in sk.STUBBED[sub]:
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.{name} "):
            getattr(sys.modules[f"sgl_kernel.{sub}"], name)(torch.zeros(1))


def test_amx_detection_stays_off(real_import_fails: None) -> None:
    """SGLang enables its AMX kernels if torch.ops.sgl_kernel has convert_weight_packed."""
    sk.install_if_needed()
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")
    from sglang.srt.utils.common import cpu_has_amx_support

    assert not cpu_has_amx_support()


def test_torch_op_stubs_bind_and_raise_naming_the_op(real_import_fails: None) -> None:
    """Qwen3.5's CPU path binds these at import (the Qwen-VL processor imports it): they exist,
    and calling one raises NotImplementedError naming it; installing again keeps them."""
    sk.install_if_needed()
    sk._register_torch_op_stubs()
    for name in sk.TORCH_OP_STUBS:
        with pytest.raises(NotImplementedError, match=f"sgl_kernel.{name} "):
            getattr(torch.ops.sgl_kernel, name)(torch.zeros(1))
    import sglang.srt.models.qwen3_5  # noqa: F401


# --- startup import hook (.pth) --------------------------------------------------------


def _fake_sgl_kernel(root: Path, body: str) -> str:
    """A fake ``sgl_kernel`` package under ``root`` whose ``__init__`` runs ``body``."""
    pkg = root / "sgl_kernel"
    pkg.mkdir()
    counter = root / "executions"
    (pkg / "__init__.py").write_text(f"open({str(counter)!r}, 'a').write('x')\n{body}")
    (pkg / "scalar_type.py").write_text("ScalarType = int\n")
    return str(root)


def _run_with_hook(root: Path, check: str) -> None:
    """Run ``check`` in a fresh interpreter after site.py processed the hook's .pth twice."""
    site_dir = root / "site"
    site_dir.mkdir()
    import_hook.write_import_hook(site_dir)
    code = (
        "import site, sys\n"
        f"site.addsitedir({str(site_dir)!r}); site.addsitedir({str(site_dir)!r})\n"
        f"assert [type(f).__name__ for f in sys.meta_path].count({import_hook._HOOK!r}) == 1\n"
        "from sgl_ragged.compat import sgl_kernel_cpu as sk\n"
    )
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code + check], check=True, timeout=120, env=env)


def test_hook_falls_back_to_standin(tmp_path: Path) -> None:
    _fake_sgl_kernel(tmp_path, "import sgl_kernel.scalar_type\nraise ImportError('no cuda')\n")
    _run_with_hook(
        tmp_path,
        "import sgl_kernel\n"
        "assert sk.is_standin_installed() and sgl_kernel.rmsnorm is sk.rmsnorm\n"
        "from sgl_kernel import copy_all_layer_kv_cache_cpu\n"
        "from sgl_kernel.mamba import causal_conv1d_fn_cpu\n"
        "assert 'sgl_kernel.scalar_type' not in sys.modules\n"
        "try:\n    import sgl_kernel.scalar_type\nexcept ImportError:\n    pass\n"
        "else:\n    raise AssertionError('half-imported real submodule is reachable')\n"
        "assert sk.install_if_needed() is True\n",
    )
    assert (tmp_path / "executions").read_text() == "x"


def test_install_if_needed_reports_standin_loaded_by_hook(tmp_path: Path) -> None:
    _fake_sgl_kernel(tmp_path, "raise ImportError('no cuda')\n")
    _run_with_hook(tmp_path, "assert sk.install_if_needed() is True\n")


def test_hook_loads_real_package_once(tmp_path: Path) -> None:
    _fake_sgl_kernel(tmp_path, "REAL = True\n")
    _run_with_hook(
        tmp_path,
        "import sgl_kernel, sgl_kernel.scalar_type\n"
        "assert sgl_kernel.REAL and not sk.is_standin_installed()\n"
        "assert sk.install_if_needed() is False\n",
    )
    assert (tmp_path / "executions").read_text() == "x"


def test_find_spec_ignores_other_names() -> None:
    assert sk.find_spec("sgl_kernel_other") is None
    assert sk.find_spec("torch") is None


def test_pth_line_is_one_import_line(tmp_path: Path) -> None:
    path = import_hook.write_import_hook(tmp_path)
    assert path.name == import_hook.PTH_NAME and path.read_text() == import_hook.PTH_LINE + "\n"
    assert import_hook.PTH_LINE.startswith("import ") and "\n" not in import_hook.PTH_LINE
    compile(import_hook.PTH_LINE, import_hook.PTH_NAME, "exec")  # site.py only warns on errors


def _dual_gemm_module(tmp_path, body: str):
    """Import sk.DUAL_GEMM through sk.find_spec from a fake package directory holding `body`."""
    import importlib.util

    (tmp_path / "cutedsl_dual_gemm.py").write_text(body)
    spec = sk.find_spec(sk.DUAL_GEMM, [str(tmp_path)])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dual_gemm_without_cutlass_is_the_stand_in(tmp_path) -> None:
    """SGLang's CuTe DSL dual GEMM module imports cutlass at its top; without it the hook
    gives compat.dual_gemm's answers: the same modes, never a dual GEMM."""
    module = _dual_gemm_module(tmp_path, "import cutlass_not_installed_here\nLEFTOVER = 1\n")
    assert getattr(module, sk.STANDIN_FLAG) and not hasattr(module, "LEFTOVER")
    assert module.MAX_DUAL_GEMM_DECODE_TOKENS == 16
    mode = module.DualGemmQuantMode.UNQUANT
    assert int(mode) == 4 and not mode.is_quantized
    assert module.DualGemmQuantMode.DYNAMIC_PER_TOKEN.is_dynamic
    assert module.DualGemmQuantMode.STATIC_PER_TOKEN.is_per_token
    assert module.can_use_dual_gemm(1, 4096, 14336, mode) is False
    with pytest.raises(NotImplementedError, match="cutlass"):
        module.dual_gemm_swiglu(None, None)


def test_dual_gemm_real_module_is_kept(tmp_path) -> None:
    module = _dual_gemm_module(tmp_path, "MAX_DUAL_GEMM_DECODE_TOKENS = 8\n")
    assert module.MAX_DUAL_GEMM_DECODE_TOKENS == 8
    assert not getattr(module, sk.STANDIN_FLAG, False)
    assert sk.find_spec("sglang.kernels.ops.gemm.other") is None
