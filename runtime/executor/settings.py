"""What a runner builds its steps from, in one object, resolved once against the model it serves.

`StepSettings` is what the caller asks for (None: the default for the model's device and dtype);
`StepSettings.resolve(model)` gives the settings the runner uses, every None replaced and every
combination that cannot run here refused in one line. The runner (runtime.executor.runner) takes
the resolved object and reads nothing else; its start-up line (`ExecutorChoice`) says what the
resolution chose. The deployment (serving.deployment) builds its StepSettings from its own config,
once, and every EP rank resolves the same fields alike.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from runtime.executor.sampling import KERNEL, choose_sampler
from runtime.ops import kernels
from runtime.platform.device import capture_refusal


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSettings:
    """How a runner's steps run.

    `kv_cache_tokens` / `block_size`: the paged cache; `gpu_memory_utilization` (CUDA only) sizes it
    from the GPU's free memory after the weights instead (runtime.platform.device.kv_tokens_for_memory),
    leaving room for the layer states of `max_num_seqs` sequences stepping `max_rows_per_seq` rows
    each (a verify's 1 + drafts, a tree's nodes; `LayerStates.bytes_reserved`).
    `compiled`: the target (and drafter) forward through `torch.compile`; float64, sparse attention
    and linear-attention layers run eager whatever is asked.
    `batch_invariant`: every row's result independent of the other rows of its step
    (runtime.ops.batch_invariant); None: on for float64 only.
    `static_steps`: decode and verify steps padded to buckets (runtime.executor.static_step); None:
    on CUDA for a compiled deployment. `cuda_graphs`: each bucket captured once and replayed
    (CUDA; bfloat16 on sm90/sm100, or float32 with the fused experts); None: wherever static steps
    run on CUDA and the step can be captured; True where it cannot is a ValueError saying why.
    `attention_kernel` / `sampling_kernel`: the Triton paged-attention and sampling kernels; None:
    on CUDA where triton is installed (attention: float32 and bfloat16)."""
    kv_cache_tokens: int = 32768
    block_size: int = 16
    gpu_memory_utilization: float | None = None
    max_num_seqs: int = 64
    max_rows_per_seq: int = 1
    compiled: bool = False
    batch_invariant: bool | None = None
    static_steps: bool | None = False
    cuda_graphs: bool | None = False
    attention_kernel: bool | None = None
    sampling_kernel: bool | None = None

    def resolve(self, model: torch.nn.Module) -> StepSettings:
        """These settings for `model` (its device, dtype and layers), nothing left None."""
        device, dtype, cfg = model.device, model.dtype, model.config
        on_cuda = device.type == "cuda"
        float64 = dtype == torch.float64
        sparse = getattr(model, "sparse", None) is not None
        hybrid = bool(cfg.linear_layers)
        batch_invariant = float64 if self.batch_invariant is None else bool(self.batch_invariant)
        compiled = bool(self.compiled) and not float64 and not sparse and not hybrid
        static = (on_cuda and bool(self.compiled)) if self.static_steps is None else bool(self.static_steps)
        # Static buckets run neither batch-invariant steps (their tiles change with the step) nor
        # sparse or linear-attention layers (each reads its own rows' keys or state).
        static = (static or bool(self.cuda_graphs)) and not batch_invariant and not sparse and not hybrid
        graphs = self.cuda_graphs
        if graphs is None:
            from runtime.model.experts import uses_fused_experts
            graphs = on_cuda and bool(self.compiled) and capture_refusal(
                device, dtype, sync_free_experts=uses_fused_experts(model)) is None
        graphs = bool(graphs) and static and not float64   # float64 experts sync with the host
        attention = self.attention_kernel
        if attention is None:
            attention = on_cuda and kernels.available("cuda") and not float64
        if attention and not kernels.available(device.type):
            raise ValueError(f"the Triton attention kernel cannot run on {device} here (triton missing, "
                             "or TRITON_INTERPRET not 1 for CPU tensors)")
        sampling = choose_sampler(device, self.sampling_kernel) is KERNEL   # its default and refusal, once
        return replace(self, compiled=compiled, batch_invariant=batch_invariant, static_steps=static,
                       cuda_graphs=graphs, attention_kernel=bool(attention), sampling_kernel=bool(sampling))
