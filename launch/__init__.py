"""Process topology and entry points: the `metrale` CLI, the launchers that start an EP group's
worker ranks (mp, Ray), and the torchrun entry."""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the CLI imports this package first: it stays light, so Ctrl-C during start-up is caught
    from serving.deployment import Launcher

LAUNCHERS = ("ray", "mp")


def launcher_for(name: str, *, ray_options=None, worker_overrides: dict[int, dict] | None = None) -> Launcher:
    """The launcher called `name` ("ray": Ray actors in a placement group, `ray_options` a
    `launch.ray_group.RayOptions`; "mp": spawned processes), ready for `LLM(..., launcher=...)`.
    `worker_overrides` {rank: {"model_dir": ..., "dtype": ...}} is for tests of refusals."""
    if name == "mp":
        from launch.mp import MPGroup
        return partial(MPGroup, worker_overrides=worker_overrides)
    if name == "ray":
        from launch.ray_group import RayGroup, RayOptions
        return partial(RayGroup, opts=ray_options or RayOptions(), worker_overrides=worker_overrides)
    raise ValueError(f"launcher={name!r}: expected one of {', '.join(LAUNCHERS)}")
