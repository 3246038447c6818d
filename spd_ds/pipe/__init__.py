"""SPD through DeepSpeed's pipeline engine (``docs/distributed.md``).

* :mod:`~spd_ds.pipe.topology` — where the head and the target stages live in the pipe grid (``PipePlan``).
* :mod:`~spd_ds.pipe.module` — the target as a ``deepspeed.pipe.PipelineModule`` built from the partition.
* :mod:`~spd_ds.pipe.schedule` — SPD's ``PipeInstruction`` s and schedules.
* :mod:`~spd_ds.pipe.engine` — ``SPDPipelineEngine`` (a ``PipelineEngine`` subclass) and the stage runners.
* :mod:`~spd_ds.pipe.comm` — headers, payloads, preallocated buffers, deadlines.
* :mod:`~spd_ds.pipe.runner` — ``run_distributed_inference`` and ``SPDSession``.
* :mod:`~spd_ds.pipe.bench` — SPD against AR through the same pipeline (equality and speed).

Nothing is imported here: DeepSpeed is heavy to import.
"""
