"""Offline budget calibration (TANGRAM section 4.1): ``python -m sgl_ragged.calibrate``.

corpus.py (task texts) -> samples.py (token prompts) -> runner.py (model, Q/K/V capture) ->
retention.py (serving's scorer + the budget source's selection per chunk) -> statistics.py
(Eq. 5, regularity) -> writer.py (profile file); pipeline.py hands the run to the budget source
(sgl_ragged/sources/), cli.py parses arguments, summary.py and
plots.py describe a profile for ``sgl-ragged profile show|plot``.
"""
