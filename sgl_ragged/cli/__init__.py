"""``sgl-ragged``: the command line around budget profiles (main.py) and what it shows of one:
the text summary (summary.py, ``profile show``) and the plots (plots.py, ``profile plot``)."""

from __future__ import annotations

from sgl_ragged.cli.main import main

__all__ = ["main"]
