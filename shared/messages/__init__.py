"""The wire's messages, one module per direction and socket (see shared/protocol.py,
which names them all: import them from there, as `from shared import protocol as p`)."""
