"""Executors: how the engine core's steps reach the model (one process, or a tensor-parallel group)."""
