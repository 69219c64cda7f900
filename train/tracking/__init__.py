"""What a run records: metrics files, TensorBoard and Weights & Biases, the step-by-step
bookkeeping on the host, and the libraries' log noise kept in a file.

- :mod:`.metrics` (``metrics.jsonl``, TensorBoard), :mod:`.wandb_logger`, :mod:`.tracker`
  (throughput, loss-scale history, the non-finite stop rule), :mod:`.library_log`.

May import :mod:`precision` and the layers below it in :mod:`train`, up to
:mod:`train.training` (docs/design.md).
"""
