"""The guard's shell around the pure policy (supervisor/policy/): the enforcer that runs it and
carries its decisions out, admission's queue, readiness, the cache book, events and counters."""
