"""Another revision's Triton kernels (sgl_ragged/kernels/) as a package of their own, for
`bench.decode_attention --baseline`: both builds timed on the same rows in one run.

    python -m bench.triton_baseline [--rev main] [--out results/triton-baseline-<sha>]

Writes `git show <rev>:sgl_ragged/kernels/*.py` into <out>/ragged_base_kernels/ with their
imports of `sgl_ragged.kernels` renamed, and prints <out>. The copy shares everything else
(storage, layout, plans) with the working tree, so it suits revisions whose kernels read the
same tables. A lent GPU machine has no git history: make it here and carry <out> (results/ is
ignored by git; the device tool's `carry`).
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

PACKAGE = "ragged_base_kernels"
REPO = Path(__file__).resolve().parents[1]
KERNELS = "sgl_ragged/kernels"


def export(rev: str, out: Path) -> Path:
    """The kernels of `rev` as out/ragged_base_kernels (a package); returns out."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{KERNELS}"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split()
    package = out / PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    for name in names:
        if not name.endswith(".py"):
            continue
        text = subprocess.run(["git", "show", f"{rev}:{KERNELS}/{name}"], cwd=REPO, check=True,
                              capture_output=True, text=True).stdout
        (package / name).write_text(text.replace("sgl_ragged.kernels", PACKAGE))
    return out


def load(out: Path) -> dict[str, ModuleType]:
    """The exported package's modules that bench.decode_attention calls (decode, tables, batch,
    aot), imported from `out`."""
    if not (out / PACKAGE / "decode.py").is_file():
        sys.exit(f"{out} holds no {PACKAGE}/decode.py: make it with python -m bench.triton_baseline")
    sys.path.insert(0, str(out.resolve()))
    return {name: importlib.import_module(f"{PACKAGE}.{name}")
            for name in ("decode", "tables", "batch", "aot")}


def main() -> None:
    from bench.native_baseline import revision_args

    args, sha = revision_args(__doc__.split("\n\n")[0], KERNELS,
                              "results/triton-baseline-<sha>")
    print(export(args.rev, args.out or REPO / "results" / f"triton-baseline-{sha}"))


if __name__ == "__main__":
    main()
