"""Offline budget calibration (TANGRAM section 4.1): ``python -m sgl_ragged.calibrate``.

pipeline.py loads the model and samples (sgl_ragged/emulator/) and hands the run to the budget
source (sgl_ragged/sources/: per-chunk selection, Eq. 5 statistics, the profile writer);
cli.py parses arguments; tier_search.py searches row compositions (``sgl-ragged profile tiers``).
"""
