"""The wire between supervisor and workers: protocol messages, the
shared-memory ledger layout and size parsing. Imports nothing from
`supervisor` or `worker` and does no I/O at import time."""
