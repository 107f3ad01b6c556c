"""Model, checkpoint loading, KV cache, sampler, scheduler and engine loop (rank 0)."""
from runtime.sampler import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing the sampler alone must not load the model stack
        from runtime.llm import LLM
        return LLM
    raise AttributeError(name)
