"""The core: model definitions, checkpoint loading, KV cache, attention, sampler, sequences,
scheduler and tokenizer. It imports no other package of the project (docs/design.md §2)."""
from runtime.sampler import SamplingParams

__all__ = ["SamplingParams"]
