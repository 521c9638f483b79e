"""The memvisor supervisor: CLI, config, probes, the guard's policy, the
enforcer loop, the worker pool and the HTTP front door. Never imports MLX."""
