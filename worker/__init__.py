"""The worker room: one model in MLX per process (DESIGN.md).

Kept import-free on purpose: the supervisor imports the MLX-free helpers
(`shared.weights`, `worker.modelgen`) and must never pull MLX in with them.
"""
