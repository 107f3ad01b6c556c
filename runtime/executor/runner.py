"""Runs the model over one step's chunks on a paged KV cache (single process).

Shapes: T step tokens, B sequences, H hidden, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.ops import cpu_ops
from runtime.executor.attention import NATIVE_INVARIANT, PagedAttention, SeqChunk, StepPlan, choose_attention_backend
from runtime.executor.sampling import choose_sampler
from runtime.executor.settings import StepSettings
from runtime.executor.step import choose_step_mode
from runtime.ops.batch_invariant import set_batch_invariant
from runtime.executor.compiled import compile_step
from runtime.platform.device import kv_tokens_for_memory, use_device
from runtime.executor.kv_cache import NO_LAYER_STATES, LayerStates, PagedKVCache
from runtime.model.experts import choose_experts_backends, uses_fused_experts
from runtime.model.layers import Linear, choose_gemms
from runtime.model.linear_attention import RecurrentStates
from runtime.model.causal_lm import CausalLM
from runtime.executor.static_step import StepGraphs



def cache_layers(model: CausalLM) -> int:
    """Cache layers the model needs: its target layers, plus one for the MTP layer."""
    cfg = model.config
    return cfg.num_cache_layers if model.mtp is not None else cfg.num_attention_layers


def kv_bytes_per_token(model: CausalLM) -> int:
    """KV cache bytes one token takes over every cache layer of this model (this rank's heads)."""
    layout = model.cache_layout()
    planes = 1 if layout["latent_dim"] is not None else 2
    return cache_layers(model) * layout["num_kv_heads"] * layout["head_dim"] * planes * model.dtype.itemsize


def choose_layer_states(model: CausalLM) -> LayerStates:
    """The layer-state backend of `model`'s cache: a hybrid model's conv and recurrent states (the
    heads this rank holds; freed with each sequence's blocks), else nothing."""
    if model.config.linear_layers:
        return RecurrentStates.for_model(model, dtype=model.dtype, device=model.device)
    return NO_LAYER_STATES


@dataclass(frozen=True, slots=True)
class ExecutorChoice:
    """What a runner chose at start, once: how its steps execute and which backends they run.
    Its text is the start-up line (`serving.deployment` logs it)."""
    device: str
    dtype: str
    execution: str                  # the step mode (runtime.executor.step): "eager", "compiled", ...
    static_steps: str               # "off", "padded" (the CPU runs the buckets) or "captured" (CUDA graphs)
    batch_invariant: bool
    attention: str                  # the cache's attention backend (runtime.executor.attention)
    experts: tuple[tuple[str, int], ...]   # routed-experts backends and how many layers run each
    linears: tuple[tuple[str, int], ...] = ()   # GEMMs of the linears (runtime.model.layers.gemm_for), counts
    layer_states: str = "none"      # the cache's layer-state backend (runtime.executor.kv_cache.LayerStates)
    sampler: str = "torch"          # the sampler backend (runtime.executor.sampling)

    def __str__(self) -> str:
        experts = ", ".join(f"{name} x{n}" for name, n in self.experts) or "none"
        linears = ", ".join(f"{name} x{n}" for name, n in self.linears) or "none"
        return (f"{self.device} {self.dtype}: {self.execution} steps, static steps {self.static_steps}, "
                f"batch-invariant {'on' if self.batch_invariant else 'off'}, attention {self.attention}, "
                f"linears {linears}, routed experts {experts}, layer states {self.layer_states}, "
                f"sampler {self.sampler}")


class ModelRunner:
    def __init__(self, model: CausalLM, settings: StepSettings | None = None, **kwargs) -> None:
        """A runner of `model`'s steps, built from `settings` (runtime.executor.settings; keyword
        arguments instead build one: `ModelRunner(model, kv_cache_tokens=1024)`), resolved here once
        against the model (`self.settings`). The cache and every step tensor live on the model's
        device; every backend is chosen here, and `self.choice` says which."""
        if settings is not None and kwargs:
            raise TypeError("give StepSettings or its fields as keywords, not both")
        st = self.settings = (settings or StepSettings(**kwargs)).resolve(model)
        kv_cache_tokens, block_size = st.kv_cache_tokens, st.block_size
        cfg = model.config
        self.model = model
        self.batch_invariant = st.batch_invariant
        set_batch_invariant(model, self.batch_invariant)
        if model.mtp is not None:
            # The MTP drafter keeps the default kernels: its drafts decide which tokens are
            # checked, never which are committed (the target's rows, batch-invariant, decide).
            set_batch_invariant(model.mtp, False)
        # Each routed-experts module's backend, chosen now that its dtype, device and modes are set.
        self.experts_backends = choose_experts_backends(model)
        self.gemms = choose_gemms(model)   # and every linear's GEMM
        # A compiled batch-invariant step: its GEMMs, experts and attention are opaque ops whose
        # row count never becomes a guard, so one graph (one set of generated kernels) serves
        # every row count (`self.mode` below). It rounds otherwise than the eager step (both
        # invariant), so every EP rank compiles or none does (the handshake's COMPILED_BIT).
        # Sparse attention (runtime.model.sparse_attention) runs eager over the padded plan: no compiled
        # step, no batch-invariant tiles, no static steps (it reads each row's visible keys itself).
        # Linear-attention layers (runtime.model.linear_attention) run eager over a recurrent state per
        # sequence: no compiled, static or captured step for them.
        sparse = model.sparse is not None
        self.plan_tiles = self.batch_invariant and not sparse
        self.compiled = st.compiled
        # The step's graphs and guards are this model's own (runtime.executor.compiled). No size and stride
        # asserts around every extern kernel (over a hundred a step; design §3.4).
        options = {"size_asserts": False}
        if self.batch_invariant:
            # Fused kernels keep 16-bit intermediates in float32 unless told to round them as
            # eager does; then a sum two ranks all-reduce in bfloat16 (the output projection's
            # halves) would round otherwise on one rank than across two.
            options["emulate_precision_casts"] = True
            # A GEMM the graph calls itself (`bi.linear`'s rows) must stay that call: the
            # pattern matcher would fold a residual add into it (addmm, which rounds otherwise).
            options["pattern_matcher"] = False
        # The final norm and the head as one graph too (a fused norm kernel instead of ~6 eager ops,
        # design §3.4), where the head is this process's own linear: not a batch-invariant one on
        # GEMM plans (a batch-invariant head on the native kernel is one opaque op at every row
        # count), nor an EP rank's vocabulary shard with its gather.
        plain_head = type(model.lm_head) is Linear and (
            not self.batch_invariant or cpu_ops.invariant_linear(model.dtype, model.lm_head.weight))
        self._logits = (compile_step(model.compute_logits, options) if self.compiled and plain_head
                        else model.compute_logits)
        self.logits_dtype = torch.float64 if model.dtype == torch.float64 else torch.float32   # what sampling reads
        self.config = cfg
        self.device = model.device
        use_device(self.device)   # streams, graphs and kernels that name no device go to the model's GPU
        # The layer-state backend (chosen here once), sized into the memory budget below.
        self.states = choose_layer_states(model)
        if st.gpu_memory_utilization is not None:
            kv_cache_tokens = kv_tokens_for_memory(self.device, st.gpu_memory_utilization, kv_bytes_per_token(model),
                                                   self.states.bytes_reserved(st.max_num_seqs, st.max_rows_per_seq))
        num_blocks = max(1, kv_cache_tokens // block_size)
        self.cache = PagedKVCache(num_layers=cache_layers(model), num_blocks=num_blocks, block_size=block_size,
                                  dtype=model.dtype, device=self.device, **model.cache_layout())
        kernel = None
        if st.attention_kernel and not self.plan_tiles and not sparse:
            from runtime.ops.kernels.paged_attention import paged_attention as kernel
        # Every step planned on this cache (the target's, and the drafter's on its plane) attends
        # through this backend, chosen here once.
        self.attention = choose_attention_backend(self.cache, batch_invariant=self.plan_tiles, kernel=kernel,
                                                  sparse=sparse)
        # Batch-invariant attention through the native op in place (not the tiles): the one-row
        # compiled step needs no two copies of its row then (`forward`).
        self.plan_native = self.attention is NATIVE_INVARIANT
        # How the target's steps run, chosen here once (runtime.executor.step): eager, compiled, or
        # compiled with a one-row step as two copies of its row (batch-invariant kernels that are not
        # row-invariant at one row: Dynamo would specialise a graph to one row; not over the native
        # ops, where the one-row graph gives a row the bits of any other graph,
        # test_compiled_step_rows_do_not_depend_on_the_step).
        self.mode = choose_step_mode(model.forward, model, compiled=self.compiled,
                                     row_twice=self.batch_invariant and not self.plan_native, options=options)
        # How every step's rows are drawn (the engine's and the verifier's), chosen here once.
        self.sampler = choose_sampler(self.device, st.sampling_kernel)
        self.cache.states = self.states
        self.graphs: StepGraphs | None = None
        if st.static_steps:
            max_keys = min(cfg.max_position_embeddings, self.cache.capacity_tokens)
            self.graphs = StepGraphs(self.mode, self.cache, max_keys, st.cuda_graphs,
                                     attention_kernel=st.attention_kernel, sync_free_experts=uses_fused_experts(model))

        self.choice = ExecutorChoice(
            device=str(self.device), dtype=str(model.dtype).removeprefix("torch."),
            execution=self.mode.name,
            static_steps="off" if self.graphs is None else self.graphs.name,
            batch_invariant=self.batch_invariant, attention=self.attention.name,
            experts=tuple(sorted(self.experts_backends.items())), linears=tuple(sorted(self.gemms.items())),
            layer_states=self.states.name, sampler=self.sampler.name)

    @torch.inference_mode()
    def forward(self, tokens: list[int], chunks: list[SeqChunk]) -> tuple[torch.Tensor, StepPlan]:
        """Run the target over the step's rows (sequence-major, matching `chunks`).

        Returns the pre-norm hidden states [T, H] and the step plan.
        """
        shape = self.graphs.shape_of(chunks) if self.graphs is not None else None
        if shape is not None:
            return self.graphs.run(tokens, chunks, shape)
        plan = self.attention.plan(self.cache, chunks)
        paged = PagedAttention(self.cache, plan)
        paged.states = self.states.step(chunks)
        tokens_t = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.mode((tokens_t,), plan.positions, paged), plan

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """Logits of `rows` of a forward's pre-norm hidden [T, H] -> float32 (or float64) [N, V]."""
        first = rows[0] if rows else 0
        if rows == list(range(first, first + len(rows))):   # consecutive (a decode step's): a view, no gather
            picked = hidden[first:first + len(rows)]
        else:
            picked = hidden[rows]
        return self._logits(picked).to(self.logits_dtype)
