"""The worker room: one model in MLX per process (docs/architecture.md).

Kept import-free on purpose: the supervisor imports the spawn target
(`worker.main`, which imports no MLX at module level) and must never pull MLX
in with it. What writes model folders lives in `modelfiles/`.
"""
