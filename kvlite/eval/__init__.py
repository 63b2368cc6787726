"""Scripted evaluation: generated long-context tasks and LongBench-format data, run as grids of
policies x budgets, scored for accuracy and for fidelity to the full cache (`kvlite eval`)."""
