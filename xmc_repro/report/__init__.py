"""The paper's tables from MLflow: export runs to results/runs.csv, render tables and figures beside the paper.

`python -m xmc_repro.report export|render|smoke` (the stages of dvc.yaml). The report reads only MLflow (and the
sweep presets in conf/, to know which configurations a table should have), never training internals.
"""
