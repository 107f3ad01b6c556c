"""Everything one `LLM` (offline, served or benchmarked) runs by, in one object, resolved once.

`Settings` gathers the four resolved parts, each owned by its layer: where and on how many ranks
the model runs (`serving.deployment.DeploymentConfig`), the scheduler's limits
(`engine.engine.EngineConfig`), speculation (`speculative.settings.SpecSettings`, resolved from
arguments, the published CLI values, the environment, the model folder's metrale.toml and the
defaults) and the step (`runtime.executor.settings.StepSettings`, resolved against rank 0's model:
compiled, batch-invariant, static buckets, CUDA graphs, kernels). Nothing below reads a setting
from anywhere else; `LLM.settings` is the object, and `str()` of it is one line per part.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from engine.engine import EngineConfig
from runtime.executor.settings import StepSettings
from serving.deployment import DeploymentConfig
from speculative.settings import SpecSettings


@dataclass(frozen=True, slots=True)
class Settings:
    deployment: DeploymentConfig
    engine: EngineConfig
    spec: SpecSettings
    step: StepSettings

    def __str__(self) -> str:
        def line(name: str, obj) -> str:
            fields = asdict(obj) if hasattr(obj, "__dataclass_fields__") else vars(obj)
            return f"{name}: " + ", ".join(f"{k}={v}" for k, v in fields.items())
        return "\n".join(line(n, getattr(self, n)) for n in ("deployment", "engine", "spec", "step"))
