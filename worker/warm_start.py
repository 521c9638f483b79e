"""What a worker does before any model is named (SPEC W1, W3's `hello` phase).

A spare does it while it waits for a load to hand it a model, a fresh worker first
thing: import MLX, mlx-lm, the tokenizer stack and the engine, and run one tiny
computation on the default device, so that both load from the same point. Kept
apart from `worker.loader` (the load's phases): this imports the engine, which
imports the loader, and a module that is imported must not import its importer.

MLX is imported inside the function, never at module level (the supervisor
imports worker.main, which imports this module's importers).
"""

from __future__ import annotations


def prepare_engine() -> str:
    """What a spare does before any model is named (SPEC W1): import MLX, mlx-lm, the
    tokenizer stack and the engine, and run one tiny computation on the default device
    (the CPU's BLAS and threads, or a GPU's context, set up). Also what a fresh worker
    does first, so both load from the same point. Returns the default device's name."""
    import mlx.core as mx

    from worker import gpu_kernels

    gpu_kernels.keep_private(mx)  # before the first computation: MLX compiles GPU kernels from here on
    import mlx_lm.models.llama  # noqa: F401  (the architecture of most models, and of the demo's)
    import mlx_lm.tokenizer_utils  # noqa: F401
    import mlx_lm.utils  # noqa: F401

    import worker.engine  # noqa: F401  (the engine and everything a request touches first)
    import worker.tokens  # noqa: F401

    _import_what_the_first_tokenizer_does()
    a = mx.ones((64, 64))
    mx.eval(a @ a)
    return str(mx.default_device())


# What transformers imports the first time a process builds a tokenizer (4.57: PIL through its
# image and video processors' modules, a llama config's module): 10 ms of CPU, and 50-90 ms
# of a loaded 2-core machine's wall clock, that a spare pays before the load instead of during it.
FIRST_TOKENIZER_IMPORTS = ("transformers.image_utils", "transformers.video_utils", "transformers.image_transforms",
                           "transformers.utils.type_validators", "transformers.models.llama.configuration_llama")


def _import_what_the_first_tokenizer_does() -> None:
    import importlib

    for name in FIRST_TOKENIZER_IMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:  # another transformers: its first tokenizer pays what it pays
            pass
