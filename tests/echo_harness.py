"""Prompt logprobs computed the plain way, to check echo against (no tests here).

`reference_logprobs` loads the model with mlx_lm in a process of its own (loading it
into the test process would change the supervisor's own footprint for later tests),
runs each whole prompt through it in one forward pass and takes the float32
log-softmax: the logprob of every prompt token after the first, given the ones before.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import json, sys
import mlx.core as mx
import mlx_lm
model, tokenizer = mlx_lm.load(sys.argv[1])
out = []
for tokens in json.loads(sys.argv[2]):
    logits = model(mx.array(tokens)[None])[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    out.append([logprobs[i, tokens[i + 1]].item() for i in range(len(tokens) - 1)])
print(json.dumps(out))
"""


def reference_logprobs(folder: Path | str, prompts: list[list[int]]) -> list[list[float]]:
    """For each token-id prompt, the logprobs of its tokens 2..n (mlx_lm, one whole forward pass)."""
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(folder), json.dumps(prompts)],
                          capture_output=True, text=True, check=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])
