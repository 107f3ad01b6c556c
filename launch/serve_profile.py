"""`python -m launch.serve_profile`: bench.serve.profile with the mp launcher, so --ep > 1 runs an
EP group (rank 0, the profiled process, serves; the worker ranks are spawned processes)."""
from __future__ import annotations

from bench.serve.profile import main
from launch import launcher_for

if __name__ == "__main__":
    raise SystemExit(main(launcher=launcher_for("mp")))
