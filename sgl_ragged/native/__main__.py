"""`python -m sgl_ragged.native build`: build the native kernels (or find the cached build
without importing torch) and print where they are; on failure, the compiler log's path and
exit status 1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sgl_ragged import native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_ragged.native")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--verbose", action="store_true", help="print the compiler output")
    args = parser.parse_args(argv)
    if native.is_built() and not args.verbose:
        print(f"sgl-ragged native kernels: up to date in {native.cache_dir()}")
        return 0
    try:
        module = native.build(verbose=args.verbose)
    except native.NativeUnavailableError as e:
        print(f"sgl-ragged: {e}", file=sys.stderr)
        return 1
    print(f"sgl-ragged native kernels: built in {native.cache_dir()} "
          f"({Path(module.__file__).name}, ISA {module.isa()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
