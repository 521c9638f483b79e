"""The model-files room: what writes MLX model folders, for either side.

The demo-model generator (`modelgen`, `embedgen`), the GGUF importer
(`gguf_import`, reading blocks with `gguf_tensors` and the tokenizer with
`gguf_tokenizer`) and the staged write both use (`staging`). Nothing here serves
a model, decides policy, or imports `supervisor` or `worker`.

Why a room of its own: the supervisor builds the demo models on first run and
imports GGUF files on first load, and it must never import MLX nor reach into
the worker beyond its spawn target. Everything here but `gguf_import` imports
only numpy, tokenizers and safetensors; `gguf_import` needs MLX (its array
conversions) and so only ever runs as a child process
(`python -m modelfiles.gguf_import`, supervisor/models/gguf_import_cache.py).

Kept import-free on purpose, as `worker/__init__` is: importing one module of
the room must not pull in another's dependencies.
"""
