"""SPD through DeepSpeed's pipeline engine (``docs/distributed.md``).

* :mod:`~spd_ds.pipe.topology` — where the head and the target stages live in the pipe grid (``PipePlan``).
* :mod:`~spd_ds.pipe.module` — the target as a ``deepspeed.pipe.PipelineModule`` built from the partition.
* :mod:`~spd_ds.pipe.schedule` — SPD's ``PipeInstruction`` s and schedules.
* :mod:`~spd_ds.pipe.engine` — ``SPDPipelineEngine`` (a ``PipelineEngine`` subclass): wiring and scheduling; each
  instruction runs as a method of the rank's role:
  :mod:`~spd_ds.pipe.head_rank` (the head rank's transport), :mod:`~spd_ds.pipe.spd_head` (SPD's cycle on the head,
  driving :mod:`spd_ds.decoding.cycle`), :mod:`~spd_ds.pipe.ar_pipe` (AR through the pipeline),
  :mod:`~spd_ds.pipe.stage_rank` (a stage rank).
* :mod:`~spd_ds.pipe.stage_runner` — one target stage's forwards (eager, or static cache + CUDA graph).
* :mod:`~spd_ds.pipe.links` and :mod:`~spd_ds.pipe.comm` — a rank's links; headers, payloads, buffers, deadlines.
* :mod:`~spd_ds.pipe.watchdog` — a stalled rank ends its process.
* :mod:`~spd_ds.pipe.runner` — ``run_distributed_inference`` and ``SPDSession``.

Nothing is imported here: DeepSpeed is heavy to import.
"""
