"""The core, in five layers (docs/design.md §2), each importing only those below it:

- `runtime.executor`: one step on a paged KV cache: the step plan, the runner, compiled and
  captured steps, the caches.
- `runtime.model`: the model: configs, the family registry, checkpoint loading, the CausalLM and
  its layers.
- `runtime.sample`: the sampler and the grammar masks.
- `runtime.ops`: kernels: batch-invariant ops, the native CPU library, the Triton kernels.
- `runtime.platform`: the device, the process heap, and the one reader of environment variables.

It imports no other package of the project."""
from runtime.sample.sampler import SamplingParams

__all__ = ["SamplingParams"]
