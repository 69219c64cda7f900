"""Tensor (and sequence) parallelism: the plan of which params the mesh's ``tensor`` axis splits."""
