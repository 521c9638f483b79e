"""The pressure lab: named scenarios run on real workers, each recorded as a
timeline, checked against the SPEC rules it exercises and drawn as a PNG.

`python -m supervisor lab [SCENARIO ...]` (supervisor/cli/lab.py) runs them;
`supervisor.lab.scenarios` holds them, `supervisor.lab.runner` the harness
(an in-process Arbiter: workers import MLX in their own processes, this
process never does), `supervisor.lab.timeline` the record and
`supervisor.lab.plot` the picture.
"""
