"""`python -m sgl_ragged.native build`: build the native kernels (or reuse the cached build)
and print where they are; on failure, the compiler log's path and exit status 1."""

from __future__ import annotations

import argparse
import sys

from sgl_ragged import native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sgl_ragged.native")
    parser.add_argument("command", choices=["build"])
    parser.add_argument("--verbose", action="store_true", help="print the compiler output")
    parser.parse_args(argv)
    try:
        module = native.build(verbose=parser.parse_args(argv).verbose)
    except native.NativeUnavailableError as e:
        print(f"sgl-ragged native kernels: {e}", file=sys.stderr)
        return 1
    print(f"sgl-ragged native kernels: built in {native.cache_dir()} "
          f"({module.__file__}, ISA {module.isa()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
