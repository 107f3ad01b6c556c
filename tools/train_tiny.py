"""Train the embedded default model: a small GLM-4.5 MoE with one MTP layer, on this machine's CPU.

Corpus: the Python standard library's own source (every machine has it), test packages excluded;
files whose name hashes into the held-out bucket are kept for evaluation. Vocabulary: a byte-level
BPE trained with `tokenizers`. Loss: next-token cross-entropy plus `--mtp-weight` times the MTP
layer's next-next-token cross-entropy (DeepSeek-V3's MTP objective). MoE load balance: the
auxiliary-loss-free bias update (router `e_score_correction_bias` nudged toward even load).

It uses the runtime's own model code. Progress goes to stdout; `--out/train.pt` is a resumable
checkpoint written every `--save-every` steps; `--export DIR` writes the Hugging Face layout.

    python tools/train_tiny.py --out runs/tiny --steps 3000
    python tools/train_tiny.py --out runs/tiny --steps 3000 --resume
    python tools/train_tiny.py --out runs/tiny --export models/tiny-glm-moe
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runtime.executor.attention import CausalAttention  # noqa: E402
from runtime.model.config import ModelConfig  # noqa: E402
from bench.corpus import corpus_files, heldout_prompts, read_source as read  # noqa: E402
from runtime.model.layers import Router  # noqa: E402
from runtime.model.causal_lm import CausalLM  # noqa: E402
from runtime.model.weights import iter_hf_state  # noqa: E402

EOS = "<|endoftext|>"


def train_tokenizer(files: list[Path], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((read(f) for f in files), trainer=trainer)
    tok.save(str(out))
    return tok


def encode_files(tok, files: list[Path]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch([read(f) for f in files], add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def model_config(args, vocab_size: int, eos: int) -> ModelConfig:
    return ModelConfig(vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=max(1, args.heads // 2), head_dim=args.hidden // args.heads,
                       moe_intermediate_size=args.moe_intermediate, num_experts_per_tok=2,
                       n_routed_experts=args.experts, n_shared_experts=1, routed_scaling_factor=1.0,
                       n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
                       use_qk_norm=False, rms_norm_eps=1e-5, rope_theta=10000.0, partial_rotary_factor=0.5,
                       max_position_embeddings=2048, num_nextn_predict_layers=1, eos_token_ids=(eos,))


def init_weights(model: CausalLM, std: float = 0.02) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("e_score_correction_bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)
            if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                p.mul_(1.0 / math.sqrt(2 * model.config.num_hidden_layers))


def losses(model: CausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """batch [B, S+2] -> (next-token loss, MTP next-next-token loss)."""
    b, s2 = batch.shape
    s = s2 - 2
    tokens = batch[:, :s + 1]
    pos = torch.arange(s + 1).repeat(b)
    hidden = model(tokens.reshape(-1), pos, CausalAttention(b, s + 1))          # [B*(S+1), H]
    logits = model.compute_logits(hidden).view(b, s + 1, -1)
    main = F.cross_entropy(logits[:, :s].reshape(-1, logits.shape[-1]), batch[:, 1:s + 1].reshape(-1))
    # MTP row i pairs the target's hidden at i with token i+1 and predicts token i+2.
    prev = hidden.view(b, s + 1, -1)[:, :s].reshape(b * s, -1)
    mtp_pos = torch.arange(s).repeat(b)
    mtp_hidden = model.mtp_forward(batch[:, 1:s + 1].reshape(-1), prev, mtp_pos, CausalAttention(b, s))
    mtp_logits = model.mtp_logits(mtp_hidden)
    mtp = F.cross_entropy(mtp_logits, batch[:, 2:s + 2].reshape(-1))
    return main, mtp


def expert_load_hooks(model: CausalLM) -> dict[Router, torch.Tensor]:
    loads: dict[Router, torch.Tensor] = {}

    def hook(mod: Router, _inp, out) -> None:
        loads[mod] = loads.get(mod, 0) + torch.bincount(out[2].reshape(-1), minlength=mod.num_experts)

    for m in model.modules():
        if isinstance(m, Router):
            m.register_forward_hook(hook)
    return loads


@torch.no_grad()
def evaluate(model, data: np.ndarray, seq: int, batches: int = 8, batch: int = 8) -> tuple[float, float]:
    model.eval()
    rng = np.random.default_rng(1234)
    tot_main = tot_mtp = 0.0
    for _ in range(batches):
        starts = rng.integers(0, len(data) - seq - 2, size=batch)
        x = torch.from_numpy(np.stack([data[i:i + seq + 2] for i in starts]).astype(np.int64))
        main, mtp = losses(model, x)
        tot_main += main.item()
        tot_mtp += mtp.item()
    model.train()
    return tot_main / batches, tot_mtp / batches


def export(model: CausalLM, out_dir: Path, tokenizer_path: Path, meta: dict) -> None:
    from safetensors.torch import save_file
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    tensors = {name: t.detach().to(torch.bfloat16).contiguous().clone() for name, t in iter_hf_state(model)}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf = cfg.to_hf_dict()
    hf["dtype"] = "bfloat16"
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": list(cfg.eos_token_ids), "do_sample": False}, indent=2) + "\n")
    (out_dir / "tokenizer.json").write_bytes(tokenizer_path.read_bytes())
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "model_max_length": 2048}, indent=2) + "\n")
    (out_dir / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
    prompts = heldout_prompts(64)  # the benchmark's prompts: cut from files the model never saw
    (out_dir / "heldout_prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/tiny"))
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--mtp-weight", type=float, default=0.5)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=256)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--fp32", action="store_true", help="train in float32 (default: bfloat16 autocast)")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export", type=Path, default=None, help="write the HF folder from the last checkpoint and exit")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    from tokenizers import Tokenizer

    tok_path = args.out / "tokenizer.json"
    train_files, held_files = corpus_files()
    if not tok_path.is_file():
        t0 = time.time()
        train_tokenizer(train_files, args.vocab, tok_path)
        print(f"tokenizer: {args.vocab} tokens from {len(train_files)} files in {time.time() - t0:.0f}s", flush=True)
    tok = Tokenizer.from_file(str(tok_path))
    data_path = args.out / "data.npz"
    if not data_path.is_file():
        np.savez(data_path, train=encode_files(tok, train_files), held=encode_files(tok, held_files))
    data = np.load(data_path)
    train, held = data["train"], data["held"]
    print(f"corpus: {len(train_files)} train files {len(train)} tokens, {len(held_files)} held-out files "
          f"{len(held)} tokens", flush=True)

    ckpt_path = args.out / "train.pt"
    state = torch.load(ckpt_path, weights_only=False) if (args.resume or args.export) and ckpt_path.is_file() else None
    if state is not None:
        cfg = ModelConfig(**{**state["config"], "eos_token_ids": tuple(state["config"]["eos_token_ids"])})
    else:
        cfg = model_config(args, tok.get_vocab_size(), tok.token_to_id(EOS))
    model = CausalLM(cfg)
    init_weights(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr,
                            betas=(0.9, 0.95), weight_decay=0.1)
    step, elapsed, history = 0, 0.0, []
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, elapsed, history = state["step"], state["elapsed"], state["history"]
        print(f"resumed at step {step} ({elapsed / 60:.1f} min trained)", flush=True)
    if args.export:
        held_main, held_mtp = evaluate(model, held, args.seq, batches=32)
        meta = {"steps": step, "wall_minutes": round(elapsed / 60, 1), "batch": args.batch, "seq": args.seq,
                "train_tokens_seen": step * args.batch * args.seq, "held_out_loss": round(held_main, 4),
                "held_out_mtp_loss": round(held_mtp, 4), "corpus_train_tokens": int(len(train)),
                "corpus_held_out_tokens": int(len(held)), "history": history}
        export(model, args.export, tok_path, meta)
        print(json.dumps({k: v for k, v in meta.items() if k != "history"}), flush=True)
        return
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.1f} M parameters, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
          f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}", flush=True)
    loads = expert_load_hooks(model)
    rng = np.random.default_rng(step + 1)
    model.train()
    t_last = time.time()
    while step < args.steps:
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = rng.integers(0, len(train) - args.seq - 2, size=args.batch)
        x = torch.from_numpy(np.stack([train[i:i + args.seq + 2] for i in starts]).astype(np.int64))
        loads.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
            main, mtp = losses(model, x)
        loss = main + args.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing: raise the bias of under-used experts
            for router, load in loads.items():
                router.e_score_correction_bias.add_(1e-3 * torch.sign(load.float().mean() - load.float()))
        step += 1
        now = time.time()
        elapsed += now - t_last
        t_last = now
        if step % 10 == 0:
            tps = step * args.batch * args.seq / max(elapsed, 1e-9)
            print(f"step {step}/{args.steps} loss {main.item():.3f} mtp {mtp.item():.3f} lr {lr:.2e} "
                  f"{tps:.0f} tok/s {elapsed / 60:.1f} min", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            hm, hmtp = evaluate(model, held, args.seq)
            history.append({"step": step, "held_out_loss": round(hm, 4), "held_out_mtp_loss": round(hmtp, 4),
                            "minutes": round(elapsed / 60, 1)})
            print(f"eval step {step}: held-out loss {hm:.3f} mtp {hmtp:.3f}", flush=True)
        if step % args.save_every == 0 or step == args.steps:
            cfg_dict = {f: getattr(cfg, f) for f in cfg.__dataclass_fields__}
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                        "history": history, "config": cfg_dict}, str(ckpt_path) + ".tmp")
            Path(str(ckpt_path) + ".tmp").replace(ckpt_path)


if __name__ == "__main__":
    main()
