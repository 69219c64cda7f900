"""An experiment run from its config, ``python -m train CONFIG``: the config's names
resolved once (:mod:`.names`), the builders that turn the config into data, task, model,
optimizer and state from them (:mod:`.builders`, :mod:`.optimizers`), the loop phase by phase (:mod:`.loop`: build, resume, train,
evaluate, save), the workdir's identity (:mod:`.workdir`), Ctrl-C and SIGTERM
(:mod:`.interrupts`), what a run writes (:mod:`.outputs`) and the compilation cache
(:mod:`.compile_cache`).

May import every layer below it (docs/design.md); :mod:`train.inspections` and the CLI
import it.
"""
