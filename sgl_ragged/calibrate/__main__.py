"""``python -m sgl_ragged.calibrate``: see sgl_ragged/calibrate/cli.py."""

from sgl_ragged.calibrate.cli import main

raise SystemExit(main())
