"""The worker processes as the supervisor keeps them: spawn, messages, heartbeat, stop, reap,
restart intensity, spares, and the phases of a load."""
