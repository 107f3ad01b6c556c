from launch.cli import main

# Guarded: the mp launcher spawns ranks that import the main module again (`python launch/__main__.py ...`).
if __name__ == "__main__":
    raise SystemExit(main())
