from supervisor.cli import main

# Guarded: a spawned worker re-imports the parent's __main__ as __mp_main__.
if __name__ == "__main__":
    raise SystemExit(main())
