"""Offline budget calibration (TANGRAM section 4.1): ``python -m sgl_ragged.calibrate``.

corpus.py (task texts) -> samples.py (token prompts) -> runner.py (model, Q/K/V capture) ->
retention.py (serving's scorer + Eq. 3 per chunk) -> statistics.py (Eq. 5, regularity) ->
writer.py (profile file); pipeline.py wires them, cli.py parses arguments, summary.py and
plots.py describe a profile for ``sgl-ragged profile show|plot``.
"""
