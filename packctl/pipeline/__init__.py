"""`packctl pack`, stage by stage (run.py calls them in this order), each taking its spec
(packctl/specs.py, built once per run by `PackConfig.specs()`):

    preflight   options, inputs resolved, output lock, what an interrupted run left   run.py
    scan        every block decoded and checked once, lengths indexed                source/parquet.py
    order       sample sort into windows, whole windows to ranks                     order.py
    plan        packs per window, shapes, balance, final pack lengths                plan.py, step_loss.py
    assign      writing dealt out to ranks by tokens                                 pipeline/assign.py
    materialize tokens moved into packs, shards encoded and journaled                materialize.py
    report      metrics and manifest, then the commit                                report.py

`packctl materialize PLAN` writes a plan's output with the same assign and materialize (from_plan.py).
"""
from __future__ import annotations

from packctl.pipeline.run import PackResult, Progress, RunInterrupted, pack, run_fingerprint
from packctl.pipeline.from_plan import materialize_plan

__all__ = ["PackResult", "Progress", "RunInterrupted", "materialize_plan", "pack", "run_fingerprint"]
