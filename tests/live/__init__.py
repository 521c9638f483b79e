"""The slow real-process tests (`pytest -m slow`); tests/README.md names the files."""
