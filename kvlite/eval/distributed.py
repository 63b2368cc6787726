"""`kvlite eval --ray [ADDRESS]`: the grid's units on a Ray cluster (or a local Ray instance).

A unit is what already shares a prefill: one (model, sample) with all its cells. Each runs as a
Ray task asking for -t CPUs, in a worker process that keeps its model loaded across units. The
unit's records come back to the driver, which writes them exactly as a local run does (so resume
works across modes), as units finish. A unit whose worker dies is tried again elsewhere, up to
GridConfig.ray_retries times; a cell that fails inside a unit is an error record, as locally.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import socket

from ..engine import Model
from ..errors import KvliteError
from . import tasks
from .grid import Grid, GridConfig

_MODELS: dict[tuple[str, int | None], Model] = {}  # per worker process: loaded once, reused by its units


def _unit(cfg: GridConfig, path: str, label: str, sample: tasks.Sample, done: set) -> tuple[list, str]:
    """On a worker: the unit's events (Grid.recorder's) and the node it ran on."""
    key = (path, cfg.n_gpu_layers)
    if key not in _MODELS:
        _MODELS[key] = Model(pathlib.Path(path), n_gpu_layers=cfg.n_gpu_layers)
    events: list = []
    Grid(cfg, log=lambda msg: None).run_unit(_MODELS[key], label, sample, done, events.append, keep_reference=False)
    return events, socket.gethostname()


def _ray():
    try:
        import ray
    except ImportError:
        raise KvliteError("--ray needs Ray: pip install 'kvlite[ray]' (or bash scripts/setup.sh --test)") from None
    return ray


def run(grid: Grid, progress=None) -> dict[str, list[dict]]:
    """Run the grid's unfinished units on Ray; returns the records each node made."""
    ray = _ray()
    cfg = grid.cfg
    local = cfg.ray == "local"
    try:
        ray.init(address=None if local else cfg.ray, num_cpus=os.cpu_count() if local else None,
                 include_dashboard=False, log_to_driver=False, configure_logging=False)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - Ray's own errors are many; the message is what helps
        raise KvliteError(f"--ray {cfg.ray}: cannot {'start' if local else 'join'} Ray: {e}") from None
    try:
        return _drive(ray, grid, progress)
    finally:
        ray.shutdown()


def _drive(ray, grid: Grid, progress) -> dict[str, list[dict]]:
    cfg = grid.cfg
    threads = cfg.threads or 1  # a task's CPUs are its llama.cpp threads: no node is oversubscribed
    # the worker gets the samples themselves: no data file needs to exist on its node
    worker_cfg = dataclasses.replace(cfg, threads=threads, data=[])
    unit = ray.remote(_unit).options(num_cpus=threads, max_retries=cfg.ray_retries, retry_exceptions=False)
    done = grid.start()
    emit = grid.recorder(progress)
    pending = {}
    for path, _, label, sample in grid.units():
        todo, diag = grid.todo(label, sample, done)
        if todo or diag:
            mine = {k for k in done if k[:3] == (label, sample.task, sample.id)}
            pending[unit.remote(worker_cfg, str(path), label, sample, mine)] = (label, sample, len(todo))
    nodes: dict[str, list[dict]] = {}
    while pending:
        (ref,), _ = ray.wait(list(pending), num_returns=1)
        label, sample, n_cells = pending.pop(ref)
        try:
            events, node = ray.get(ref)
        except ray.exceptions.RayError as e:  # its worker died more often than ray_retries
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            emit(("error", {"model": label, "task": sample.task, "sample": sample.id}, f"ray: {reason}"))
            emit(("progress", n_cells))
            continue
        for event in events:
            emit(event)
        nodes.setdefault(node, []).extend(e[1] for e in events if e[0] == "record")
    return nodes
