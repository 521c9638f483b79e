"""How the processes talk: the ZeroMQ bus, the PUB fan-out and its subscribers, the control
socket and its client, work kept off the loop, the runtime folder."""
