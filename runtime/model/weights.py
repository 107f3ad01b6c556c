"""Checkpoint loading: safetensors (one file, or sharded with an index), memory-mapped.

Hugging Face names map onto the runtime's modules: `model.` is dropped, per-expert projections
`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight` are stacked into one tensor per layer,
and the MTP layer (`model.layers.{num_hidden_layers}.*`) goes to `mtp.*`. Each tensor is read
only when this process owns it (`expert_range` limits the routed experts it reads).
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from runtime.model.config import ModelConfig, load_config
from runtime.model.experts import RoutedExperts, choose_fused_experts
from runtime.model.layers import pack_for_inference
from runtime.model.causal_lm import CausalLM
from runtime.model.quantization import (FP8, SCALE_SUFFIX, Fp8BlockScheme, choose_fp8_kept, dequantize,
                                         quantization_scheme, scale_window)

_EXPERT = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
# Kept in float32 whatever the model dtype, as transformers does for the router.
_FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

# Tensors a Qwen3.5 / Qwen3.6-MoE checkpoint carries beside the text model, skipped unread: the
# vision tower (multimodal layout) and the `mtp.*` layer (not served for this family yet).
_SKIPPED = {"model.visual.": "the vision tower (text only is served)",
            "mtp.": "the MTP layer (config.json announces none: mtp_num_hidden_layers)"}
# Qwen3.5's `mtp.*` names -> the MTP layer's own (runtime.model.mtp.MTPLayer).
_QWEN35_MTP = {"fc.": "eh_proj.", "pre_fc_norm_embedding.": "enorm.", "pre_fc_norm_hidden.": "hnorm.",
               "norm.": "shared_head.norm.", "layers.0.": "block."}
log = logging.getLogger("metrale.weights")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class CheckpointError(ValueError):
    """A checkpoint whose tensors do not match the model; the message names the tensor."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where one checkpoint tensor goes: a parameter name, the expert row for stacked experts, and
    for the fused gate_up tensor which half (0 gate, 1 up)."""
    param: str
    expert: int | None = None
    half: int | None = None


def _expert_target(prefix: str, expert: int, proj: str) -> Target:
    if proj == "down_proj":
        return Target(f"{prefix}.down_proj", expert)
    return Target(f"{prefix}.gate_up_proj", expert, 0 if proj == "gate_proj" else 1)


def open_safetensors(path: Path):
    """`safe_open` of one checkpoint file; a corrupt or truncated file is a `CheckpointError` naming it."""
    try:
        return safe_open(str(path), "pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


def checkpoint_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        out = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in set(out.values()):
            if not path.is_file():
                raise FileNotFoundError(f"{path} is named in {index.name} but missing")
        return out
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_dir}")
    out = {}
    for path in files:
        with open_safetensors(path) as f:
            for name in f.keys():
                out[name] = path
    return out


def map_name(hf_name: str, cfg: ModelConfig) -> Target | None:
    """HF tensor name -> runtime parameter (None when the name has no place in this model)."""
    if cfg.layer_types and hf_name.startswith("mtp.") and cfg.num_nextn_predict_layers:
        rest = hf_name.removeprefix("mtp.").replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        for theirs, ours in _QWEN35_MTP.items():
            if rest.startswith(theirs):
                rest = ours + rest.removeprefix(theirs)
                me = re.match(r"^block\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", rest)
                if me:
                    return _expert_target("mtp.block.mlp.experts", int(me.group(1)), me.group(2))
                return Target("mtp." + rest)
        return None
    if not hf_name.startswith("model.") and hf_name != "lm_head.weight":
        return None
    name = hf_name.removeprefix("model.")
    if cfg.layer_types:   # Qwen3.5: the multimodal layout's text model, the shared expert's name
        name = name.removeprefix("language_model.").replace(".mlp.shared_expert.", ".mlp.shared_experts.")
    m = _EXPERT.match(name)
    if m and int(m.group(1)) < cfg.num_hidden_layers:
        return _expert_target(f"layers.{m.group(1)}.mlp.experts", int(m.group(2)), m.group(3))
    m = _LAYER.match(name)
    if m and int(m.group(1)) == cfg.num_hidden_layers and cfg.num_nextn_predict_layers:
        rest = m.group(2)
        me = re.match(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", rest)
        if me:
            return _expert_target("mtp.block.mlp.experts", int(me.group(1)), me.group(2))
        return Target(f"mtp.{rest}" if rest.startswith(_MTP_OWN) else f"mtp.block.{rest}")
    if m and int(m.group(1)) > cfg.num_hidden_layers:
        return None
    return Target(name)


def _model_tensor_names(model: CausalLM) -> set[str]:
    return {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()
                                                       if not n.startswith("rotary.")}


ShardSpecs = dict[str, tuple[int, int, int]]  # param -> (dim, start, stop) of the checkpoint tensor


def load_model(model_dir: str | Path, dtype: torch.dtype | str = torch.float32,
               expert_range: range | None = None,
               transform: Callable[[CausalLM], ShardSpecs] | None = None,
               mtp_only: bool = False, *, device: torch.device | str, keep_fp8: bool | None = None) -> CausalLM:
    """Build the model on `device` and fill it from the checkpoint.

    `mtp_only`: no target layers (a drafter on its own): embeddings, final norm, head and the MTP
    layer; the target layers' tensors are never read.

    `keep_fp8` (an FP8 checkpoint): whether its linear and routed-expert weights stay FP8 beside
    their scales, run by the Triton kernels (`Linear.keep_fp8`, `RoutedExperts.keep_fp8`), or are
    dequantized to `dtype` as they are read; None picks once (`quantization.choose_fp8_kept`: kept
    on CUDA with triton). Linears a module reads as matrices (its `dense_weights`) and weights of
    other modules are dequantized either way.

    `expert_range` restricts the routed experts read (global ids, the same for every layer);
    None reads all. `transform` runs on the meta-device model before any weight exists (the EP
    step that swaps layers for parallel ones) and says which slice of each sharded tensor this
    process holds (`(dim, start, stop)`, or several windows along `dim` read and joined in order:
    `(dim, start0, stop0, start1, stop1, ...)`); only that slice is read from the memory-mapped file. A tensor the model needs that the checkpoint lacks, or one it carries that
    the model has no place for, is a `CheckpointError` naming it. An MTP layer announced in
    config.json but wholly absent from the checkpoint loads as no MTP layer.
    """
    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (expected one of {', '.join(DTYPES)})")
        dtype = DTYPES[dtype]
    files = checkpoint_files(model_dir)
    scheme = quantization_scheme(json.loads((model_dir / "config.json").read_text()),
                                 source=str(model_dir / "config.json"))
    scales = {name.removesuffix(SCALE_SUFFIX): path for name, path in files.items() if name.endswith(SCALE_SUFFIX)}
    files = {name: path for name, path in files.items() if not name.endswith(SCALE_SUFFIX)}
    if cfg.layer_types:
        for prefix, what in _SKIPPED.items():
            if prefix == "mtp." and cfg.num_nextn_predict_layers:
                continue
            skipped = [name for name in files if name.startswith(prefix)]
            if skipped:
                log.info("skipping %d tensors of %s: %s*", len(skipped), what, prefix)
                files = {n: p for n, p in files.items() if not n.startswith(prefix)}
                scales = {n: p for n, p in scales.items() if not n.startswith(prefix)}
    for name in scales:
        if name not in files:
            raise CheckpointError(f"unexpected tensor {name + SCALE_SUFFIX!r}: no weight {name!r} beside it")
    if scales and scheme is None:
        raise CheckpointError(f"checkpoint {model_dir} holds FP8 scales ({next(iter(scales)) + SCALE_SUFFIX!r}) "
                              "but config.json has no quantization_config")
    mtp_prefix = "mtp." if cfg.layer_types else f"model.layers.{cfg.num_hidden_layers}."
    has_mtp = any(n.startswith(mtp_prefix) for n in files)
    if cfg.num_nextn_predict_layers and not has_mtp:
        from dataclasses import replace
        cfg = replace(cfg, num_nextn_predict_layers=0)
    experts = expert_range if expert_range is not None else range(cfg.n_routed_experts)
    if experts.step != 1 or experts.start < 0 or experts.stop > cfg.n_routed_experts:
        raise ValueError(f"expert_range {experts} is not a contiguous range inside 0..{cfg.n_routed_experts}")

    with torch.device("meta"):
        model = CausalLM(cfg, mtp_own_embed=f"{mtp_prefix}embed_tokens.weight" in files,
                                   mtp_own_head=f"{mtp_prefix}shared_head.head.weight" in files)
    if mtp_only:
        if model.mtp is None:
            raise CheckpointError(f"checkpoint {model_dir} has no MTP layer to load on its own")
        model.layers = torch.nn.ModuleList()
    _shrink_experts(model, len(experts), experts.start)
    with torch.device("meta"):  # parallel layers are swapped in without allocating
        specs = transform(model) if transform is not None else {}
    device = torch.device(device)
    kept = (_keep_fp8_weights(model, sorted(scales), cfg, scheme, specs)
            if choose_fp8_kept(scheme, device, dtype, keep_fp8) else set())
    _cast(model, dtype)   # on the meta device: every weight is allocated in its serving dtype, no float32 copy first
    model.to_empty(device=device)
    with torch.device(device):
        model.rotary.__init__(cfg)  # non-persistent buffer: recompute after leaving the meta device
    params = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())

    filled: set[str] = set()
    kept_tensors = dequantized_tensors = 0   # FP8 checkpoint tensors read as such, and dequantized
    expert_rows: dict[str, set[int]] = {}
    with ExitStack() as stack:
        handles = {p: stack.enter_context(open_safetensors(p)) for p in set(files.values())}
        for hf_name, path in sorted(files.items()):
            target = map_name(hf_name, cfg)
            if mtp_only and target is not None and target.param.startswith("layers."):
                continue  # a target layer: not part of a drafter on its own
            if target is None or target.param not in params:
                raise CheckpointError(f"unexpected tensor {hf_name!r} in {path.name}: the model has no place for it")
            if target.expert is not None and target.expert not in experts:
                continue  # another rank's expert: never read
            if mtp_only and target.param.startswith("layers."):
                continue
            dest = params[target.param]
            if target.expert is not None:
                dest = dest[target.expert - experts.start]
            if target.half is not None:
                dest = dest.chunk(2, dim=0)[target.half]
            want = dest.shape
            src_slice = handles[path].get_slice(hf_name)
            shape = list(src_slice.get_shape())
            spec = specs.get(target.param)
            windows = [] if spec is None else [(spec[0], a, b) for a, b in zip(spec[1::2], spec[2::2])]
            if spec is not None:
                dim = spec[0]
                if max(b for _, _, b in windows) > shape[dim]:
                    raise CheckpointError(f"tensor {hf_name!r} has {shape[dim]} rows on dim {dim}, "
                                          f"this rank needs {', '.join(f'{a}..{b}' for _, a, b in windows)}")
                shape[dim] = sum(b - a for _, a, b in windows)
            if tuple(shape) != tuple(want):
                raise CheckpointError(f"tensor {hf_name!r} has shape {tuple(src_slice.get_shape())}, "
                                      f"expected {tuple(want)}")
            if spec is None:
                src = handles[path].get_tensor(hf_name)
            elif len(windows) > 1:   # several windows (a split DeltaNet's q, k, v channels): read and joined
                parts = [src_slice[lo:hi] if d == 0 else src_slice[:, lo:hi] for d, lo, hi in windows]
                if hf_name in scales:   # never kept as FP8 (`_keep_fp8_weights`): each window dequantized
                    parts = [_dequantized(part, hf_name, handles[scales[hf_name]], scheme, w, dtype)
                             for part, w in zip(parts, windows)]
                    dequantized_tensors += 1
                elif parts[0].dtype == FP8:
                    raise CheckpointError(f"tensor {hf_name!r} is FP8 but the checkpoint has no "
                                          f"{hf_name + SCALE_SUFFIX!r}")
                src = torch.cat(parts, dim=spec[0])
            elif spec[0] == 0:
                src = src_slice[spec[1]:spec[2]]
            else:
                src = src_slice[:, spec[1]:spec[2]]
            if len(windows) > 1:
                pass   # read (and dequantized) window by window above
            elif hf_name in scales and target.param in kept:   # FP8 as stored, and the scale blocks it needs
                if src.dtype != FP8:
                    raise CheckpointError(f"tensor {hf_name!r} has {hf_name + SCALE_SUFFIX!r} but is {src.dtype}, not FP8")
                scale, _, _ = _scale_blocks(src, hf_name, handles[scales[hf_name]], scheme, spec)
                scale_dest = params[target.param + SCALE_SUFFIX]
                if target.expert is not None:   # stacked experts: gate and up blocked apart, as stored
                    scale_dest = scale_dest[target.expert - experts.start]
                    scale_dest = scale_dest if target.half is None else scale_dest[target.half]
                with torch.no_grad():
                    scale_dest.copy_(scale)
                filled.add(target.param + SCALE_SUFFIX)
                kept_tensors += 1
            elif hf_name in scales:
                src = _dequantized(src, hf_name, handles[scales[hf_name]], scheme, spec, dtype)
                dequantized_tensors += 1
            elif src.dtype == FP8:
                raise CheckpointError(f"tensor {hf_name!r} is FP8 but the checkpoint has no {hf_name + SCALE_SUFFIX!r}")
            with torch.no_grad():
                dest.copy_(src)
                if target.expert is not None:
                    key = f"{target.param}[{target.half}]"
                    expert_rows.setdefault(key, set()).add(target.expert)
            filled.add(target.param)

    needed = _model_tensor_names(model)
    if cfg.tie_word_embeddings:
        filled.add("lm_head.weight")
    missing = sorted(needed - filled)
    if missing:
        raise CheckpointError(f"checkpoint {model_dir} lacks tensor(s) for: {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
    for param, rows in expert_rows.items():
        if len(rows) != len(experts):
            lost = sorted(set(experts) - rows)
            raise CheckpointError(f"checkpoint lacks expert(s) {lost[:5]} for {param}")
    # What the start-up line reports: how the stored weights became the served ones.
    model.weight_format = weight_format(scheme, dtype, kept_tensors, dequantized_tensors)
    pack_for_inference(model)
    choose_fused_experts(model)   # on CUDA with triton: the sync-free Triton experts
    model.eval()
    return model


def weight_format(scheme: Fp8BlockScheme | None, dtype: torch.dtype, kept: int, dequantized: int) -> str:
    """What the start-up line says of the weights: their dtype, or how an FP8 checkpoint's are served
    (`kept`, `dequantized`: how many of its FP8 tensors this process read each way)."""
    dt = str(dtype).removeprefix("torch.")
    if scheme is None:
        return dt
    if not kept:
        return f"{scheme.describe()} in the checkpoint, dequantized to {dt} on load"
    br, bc = scheme.block
    rest = f", the other {dequantized} dequantized to {dt} on load" if dequantized else ""
    return (f"{scheme.describe()} in the checkpoint: fp8 e4m3 {br}x{bc} kept for {kept} of {kept + dequantized} "
            f"FP8 tensors (triton block-scaled matmul and fused MoE kernels){rest}")


def _keep_fp8_weights(model: CausalLM, names: list[str], cfg: ModelConfig, scheme: Fp8BlockScheme,
                      specs: ShardSpecs) -> set[str]:
    """On the meta model: each `Linear` and `RoutedExperts` whose checkpoint weights (among `names`)
    are FP8 keeps them so (`keep_fp8`), an EP rank its window of a linear with the scale blocks
    covering it (offsets inside the first block included). A linear its module reads as a matrix
    (`dense_weights`) is left to dequantize. Returns the parameters kept."""
    from runtime.model.layers import Linear
    dense = {id(getattr(m, n)) for m in model.modules() for n in getattr(m, "dense_weights", ())}
    kept: set[str] = set()
    for hf_name in names:
        target = map_name(hf_name, cfg)
        if target is None or target.param in kept:
            continue
        owner, _, leaf = target.param.rpartition(".")
        try:
            mod = model.get_submodule(owner)
        except AttributeError:   # not in this model (a drafter on its own): never read
            continue
        if target.expert is not None and isinstance(mod, RoutedExperts):
            if mod.fp8 is None:
                mod.keep_fp8(scheme.block)
            kept.add(target.param)
        elif leaf == "weight" and isinstance(mod, Linear) and id(mod) not in dense and mod.fp8 is None \
                and len(specs.get(target.param, ())) <= 3:   # one window (several: dequantized on load)
            spec = specs.get(target.param)
            offset = (0, 0)
            if spec is not None:
                offset = (spec[1] % scheme.block[0], 0) if spec[0] == 0 else (0, spec[1] % scheme.block[1])
            mod.keep_fp8(scheme.block, offset)
            kept.add(target.param)
    return kept


def _scale_blocks(src: torch.Tensor, hf_name: str, handle, scheme: Fp8BlockScheme,
                  spec: tuple[int, int, int] | None) -> tuple[torch.Tensor, int, int]:
    """The scale blocks covering the FP8 weight `src` (the whole stored tensor, or the window `spec`
    of it), read only for those blocks, and the window's first stored row and column."""
    scale_slice = handle.get_slice(hf_name + SCALE_SUFFIX)
    full = tuple(handle.get_slice(hf_name).get_shape()) if spec is not None else tuple(src.shape)
    want = (-(-full[0] // scheme.block[0]), -(-full[1] // scheme.block[1])) if len(full) == 2 else None
    if want is None or tuple(scale_slice.get_shape()) != want:
        raise CheckpointError(f"tensor {hf_name + SCALE_SUFFIX!r} has shape {tuple(scale_slice.get_shape())}, "
                              f"expected {want} for a {full} weight in {scheme.describe()}")
    row0 = col0 = 0
    if spec is None:
        scale = scale_slice[:, :]
    elif spec[0] == 0:
        lo, hi = scale_window(0, spec[1], spec[2], scheme.block)
        scale, row0 = scale_slice[lo:hi], spec[1]
    else:
        lo, hi = scale_window(1, spec[1], spec[2], scheme.block)
        scale, col0 = scale_slice[:, lo:hi], spec[1]
    return scale, row0, col0


def _dequantized(src: torch.Tensor, hf_name: str, handle, scheme: Fp8BlockScheme,
                 spec: tuple[int, int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 weight `src` (the whole stored tensor, or the window `spec` of it) times its block
    scales, read only for the blocks that window covers."""
    scale, row0, col0 = _scale_blocks(src, hf_name, handle, scheme, spec)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return dequantize(src, scale, scheme.block, row0, col0, dtype=work)


def _shrink_experts(model: CausalLM, num_local: int, offset: int) -> None:
    for mod in model.modules():
        if isinstance(mod, RoutedExperts):
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(mod, name)
                setattr(mod, name, torch.nn.Parameter(torch.empty(num_local, *p.shape[1:], device="meta")))
            mod.expert_offset = offset


def _cast(model: CausalLM, dtype: torch.dtype) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(False)
        if p.dtype == FP8:   # kept as the checkpoint stores it (`Linear.keep_fp8`)
            continue
        p.data = p.data.to(torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype)


def iter_hf_state(model: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under their Hugging Face names (experts unstacked): what `save` writes."""
    cfg = model.config
    mtp_layer = f"model.layers.{cfg.num_hidden_layers}."
    for name, tensor in model.state_dict().items():
        if name.startswith("rotary.") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if name.startswith("mtp.block."):
            hf = mtp_layer + name.removeprefix("mtp.block.")
        elif name.startswith("mtp."):
            hf = mtp_layer + name.removeprefix("mtp.")
        elif name == "lm_head.weight":
            hf = name
        else:
            hf = "model." + name
        m = re.match(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?$", hf)
        if m:
            suffix = m.group(3) or ""   # kept FP8 (`RoutedExperts.keep_fp8`): gate and up scales stacked apart
            for e in range(tensor.shape[0]):
                if m.group(2) == "down_proj":
                    yield f"{m.group(1)}.{e}.down_proj.weight{suffix}", tensor[e].contiguous()
                else:
                    gate, up = tensor[e].unbind(0) if suffix else tensor[e].chunk(2, dim=0)
                    yield f"{m.group(1)}.{e}.gate_proj.weight{suffix}", gate.contiguous()
                    yield f"{m.group(1)}.{e}.up_proj.weight{suffix}", up.contiguous()
        else:
            yield hf, tensor.contiguous()
