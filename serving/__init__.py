"""Serving: the `LLM` facade, the EP deployment and its supervised step, the async engine and the
HTTP server. `from serving import LLM, SamplingParams` is the offline entry point."""
from runtime.sample.sampler import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing the package must not load the model stack
        from serving.llm import LLM
        return LLM
    raise AttributeError(name)
