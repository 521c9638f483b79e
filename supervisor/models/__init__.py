"""The models: the catalogue and its folders, GGUF imports, pulls from the hub, each model's
life and state, reloads, prefetch and swaps."""
