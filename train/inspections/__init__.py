"""Looking at an experiment without training it: ``--explain`` (:mod:`.explain`),
``--check`` and ``--diagnose`` (:mod:`.checkup`), ``--compile-for`` a
GPU this machine does not have (:mod:`.compile_for`, :mod:`.targets`, its kernels read
back by :mod:`.gpu_kernels` and :mod:`.hlo_kernels`, timed by the model of
:mod:`.gpu_time`), ``--pick-policy`` (:mod:`.policy_pick`, :mod:`.policy_measure`), and
``python -m train export`` (:mod:`.export`: a run's weights for serving, LoRA merged).

May import everything else in :mod:`train` but the CLI (docs/design.md); only the CLI and
:mod:`train`'s ``__init__`` import it.
"""
