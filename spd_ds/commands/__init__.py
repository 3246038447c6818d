"""The command-line programs, as library modules: each has ``main(argv=None) -> int``.

pip installs them as console scripts (setup.cfg): ``spd-infer`` (:mod:`.infer`), ``spd-train`` (:mod:`.train`),
``spd-eval`` (:mod:`.eval`), ``spd-bench`` (:mod:`.benchmark`), ``spd-prepare-data`` (:mod:`.prepare_train_data`),
``spd-prepare-eval-data`` (:mod:`.prepare_eval_data`) and ``spd-build-draft-vocab`` (:mod:`.build_draft_vocab`).
``launch/<name>.py`` runs the same ``main`` from a checkout (also under ``deepspeed launch/<name>.py``), and
``python -m spd_ds.commands.<name>`` works as well. :mod:`.pipe_bench` (SPD against AR through the same
pipeline: equality and speed) has no wrapper: ``deepspeed --module spd_ds.commands.pipe_bench``.
"""
