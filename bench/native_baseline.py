"""Build another revision's native kernels (cuda_ext/) for `bench.cpu_attention --baseline`.

    python -m bench.native_baseline [--rev main] [--out ~/.cache/sgl-ragged/baseline-<rev>]

Two builds of the kernels in one process must differ in their extension name and in their C++
namespace: with the same symbols, the second one loaded may call into the first (a copied
sgl_ragged_native.so times the same code twice). This builds `git show <rev>:cuda_ext/...`
under the extension name `ragged_base` with `-Dragged=ragged_base` and prints the path of its
shared object.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from sgl_ragged.native import CFLAGS, HEADERS, LDFLAGS, SOURCES
from sgl_ragged.paths import default_cache_dir

NAME = "ragged_base"
REPO = Path(__file__).resolve().parents[1]


def export_sources(rev: str, into: Path) -> None:
    """cuda_ext/ as of `rev` into `into` (a revision without one of today's files leaves it out:
    older builds had fewer sources)."""
    into.mkdir(parents=True, exist_ok=True)
    for name in (*SOURCES, *HEADERS):
        shown = subprocess.run(["git", "show", f"{rev}:cuda_ext/{name}"], cwd=REPO,
                               capture_output=True)
        if shown.returncode == 0:
            (into / name).write_bytes(shown.stdout)


def build(rev: str, out: Path) -> Path:
    """The shared object of `rev`'s kernels named ragged_base (built in out/build)."""
    from torch.utils import cpp_extension

    src = out / "src"
    export_sources(rev, src)
    sources = [str(src / n) for n in SOURCES if (src / n).is_file()]
    build_dir = out / "build"
    build_dir.mkdir(parents=True, exist_ok=True)
    module = cpp_extension.load(name=NAME, sources=sources,
                                extra_cflags=[*CFLAGS, f"-Dragged={NAME}"],
                                extra_ldflags=list(LDFLAGS), build_directory=str(build_dir))
    return Path(module.__file__)


def revision_args(description: str, sources: str, out: str) -> tuple[argparse.Namespace, str]:
    """Parsed --rev (a git revision of `sources`, default main) and --out (default `out`) of a
    baseline tool, and the revision's short sha."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rev", default="main", help=f"git revision of {sources} (default main)")
    parser.add_argument("--out", type=Path, default=None, help=f"directory (default {out})")
    args = parser.parse_args()
    sha = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.strip()
    return args, sha


def main() -> None:
    args, sha = revision_args(__doc__.split("\n\n")[0], "cuda_ext/",
                              "$RAGGED_CACHE/baseline-<sha> ($RAGGED_CACHE: ~/.cache/sgl-ragged)")
    out = args.out or default_cache_dir() / f"baseline-{sha}"
    print(f"building cuda_ext/ of {args.rev} ({sha}) as {NAME} in {out} ...", flush=True)
    print(build(args.rev, out))


if __name__ == "__main__":
    main()
