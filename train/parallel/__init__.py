"""Devices and processes: JAX's multi-process runtime (:mod:`.processes`), the mesh and how
the train state and batches are laid out over it (:mod:`.distributed`), and what a step
sends between devices (:mod:`.communication`).

May import :mod:`precision` only (docs/design.md).
"""
