"""Train the project's reference DeepSeek-V3-architecture (MLA) language model on one GPU.

Usage (repository root; token files made by train_tokenizer.py):

    python benchmarks/reference_model/train.py --train-tokens .refdata/train.bin \
        --val-tokens .refdata/val.bin --tokenizer quantmla_hf/assets/reference_model \
        --out /tmp/refmodel --log /tmp/refmodel/train_log.txt --time-budget 450

The learning-rate schedule is a function of elapsed wall time (linear warmup over the first
--warmup-frac of --time-budget, then cosine down to --min-lr-ratio of the peak), so the run
ends on schedule whatever the throughput. Sequences are random 2049-token windows of the
packed token stream (articles separated by <|endoftext|>, id 0). At the end the final
validation loss / perplexity is computed over the whole validation stream in
non-overlapping --seq-len windows, and the model is saved in bf16 (safetensors).
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DeepseekV3Config, DeepseekV3ForCausalLM


def sdpa_padded_v(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal SDPA with V zero-padded to the QK head dim so the FlashAttention kernel applies.

    Training only (no mask, no cache): query/key [B, H, T, 128], value [B, H, T, 64].
    """
    dv = value.shape[-1]
    if dv < query.shape[-1]:
        value = F.pad(value, (0, query.shape[-1] - dv))
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out[..., :dv].transpose(1, 2).contiguous(), None


AttentionInterface.register("sdpa_padded_v", sdpa_padded_v)


def build_config(args, vocab_size):
    return DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        moe_intermediate_size=256,          # unused: every layer is dense
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        n_shared_experts=1,
        n_routed_experts=8,                 # unused (first_k_dense_replace = num_hidden_layers)
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=args.layers,  # dense MLP in every layer
        kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=args.q_lora_rank,
        qk_rope_head_dim=args.qk_rope_head_dim,
        qk_nope_head_dim=args.qk_nope_head_dim,
        v_head_dim=args.v_head_dim,
        hidden_act="silu",
        max_position_embeddings=args.max_pos,
        initializer_range=0.02,
        rms_norm_eps=1e-6,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=1,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        rope_interleave=True,
        attention_bias=False,
        attention_dropout=0.0,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-tokens", required=True)
    ap.add_argument("--val-tokens", required=True)
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json (copied next to the model)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--time-budget", type=float, default=450.0, help="seconds of training (after compile)")
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup-frac", type=float, default=0.04)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--eval-every-frac", type=float, default=0.2)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-lora-rank", type=int, default=256)
    ap.add_argument("--q-lora-rank", type=int, default=None)
    ap.add_argument("--qk-rope-head-dim", type=int, default=64)
    ap.add_argument("--qk-nope-head-dim", type=int, default=64)
    ap.add_argument("--v-head-dim", type=int, default=64)
    ap.add_argument("--max-pos", type=int, default=4096)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--attn", default="sdpa_padded_v", help="attention implementation used for training")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    os.makedirs(args.out, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.log)), exist_ok=True)
    logf = open(args.log, "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    dev = torch.device("cuda")

    train_np = np.fromfile(args.train_tokens, dtype=np.uint16)
    val_np = np.fromfile(args.val_tokens, dtype=np.uint16)
    train = torch.from_numpy(train_np.astype(np.int32)).to(dev)
    val = torch.from_numpy(val_np.astype(np.int32)).to(dev)

    config = build_config(args, args.vocab_size)
    config._attn_implementation = args.attn
    model = DeepseekV3ForCausalLM(config).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel()
    log(f"# device: {torch.cuda.get_device_name()} torch {torch.__version__}")
    import transformers
    log(f"# transformers {transformers.__version__}")
    log(f"# args: {json.dumps(vars(args))}")
    log(f"# config: {config.to_json_string(use_diff=False)}".replace("\n", " "))
    log(f"# params: {n_params} total (tied embeddings), {n_embed} embedding, {n_params - n_embed} non-embedding")
    log(f"# train tokens available: {len(train_np)}, val tokens: {len(val_np)}")

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True,
    )

    fwd = model if args.no_compile else torch.compile(model)
    T, B = args.seq_len, args.micro_batch
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)

    def get_batch():
        starts = torch.randint(0, len(train) - T - 1, (B,), device=dev, generator=gen)
        idx = starts[:, None] + torch.arange(T + 1, device=dev)[None, :]
        seq = train[idx].long()
        return seq[:, :-1], seq[:, 1:]

    def loss_fn(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = fwd(input_ids=x, use_cache=False).logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))

    @torch.no_grad()
    def evaluate():
        model.eval()
        n_win = (len(val) - 1) // T
        tot, cnt = 0.0, 0
        for i in range(0, n_win, B):
            w = torch.arange(i, min(i + B, n_win), device=dev)
            idx = w[:, None] * T + torch.arange(T + 1, device=dev)[None, :]
            seq = val[idx].long()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=seq[:, :-1], use_cache=False).logits
            tot += F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), seq[:, 1:].reshape(-1),
                                   reduction="sum").item()
            cnt += seq[:, 1:].numel()
        model.train()
        return tot / cnt, cnt

    def lr_at(frac):
        if frac < args.warmup_frac:
            return args.lr * max(frac, 1e-3) / args.warmup_frac
        p = min(1.0, (frac - args.warmup_frac) / (1 - args.warmup_frac))
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))

    # Warm-up / compile step (not counted in the time budget; its update is discarded by re-init).
    model.train()
    tc = time.time()
    x, y = get_batch()
    loss_fn(x, y).backward()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    log(f"# compile+first step: {time.time() - tc:.1f}s")

    tokens_per_step = B * T * args.grad_accum
    log(f"# tokens per step: {tokens_per_step}")
    log("step\ttokens\telapsed_s\tlr\ttrain_loss\ttok_per_s")
    t0 = time.time()
    step, tokens, next_eval = 0, 0, args.eval_every_frac
    tlast, toklast = t0, 0
    while step < args.max_steps:
        frac = (time.time() - t0) / args.time_budget
        if frac >= 1.0:
            break
        lr = lr_at(frac)
        for g in opt.param_groups:
            g["lr"] = lr
        ltot = torch.zeros((), device=dev)
        for _ in range(args.grad_accum):
            x, y = get_batch()
            loss = loss_fn(x, y) / args.grad_accum
            loss.backward()
            ltot += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += tokens_per_step
        if step % args.log_every == 0 or step == 1:
            l = ltot.item()
            now = time.time()
            log(f"{step}\t{tokens}\t{now - t0:.1f}\t{lr:.3e}\t{l:.4f}\t{(tokens - toklast) / (now - tlast):.0f}")
            tlast, toklast = now, tokens
        if frac >= next_eval:
            vl, _ = evaluate()
            log(f"# eval step {step} tokens {tokens} elapsed {time.time() - t0:.1f}s val_loss {vl:.4f} val_ppl {math.exp(vl):.2f}")
            next_eval += args.eval_every_frac
    torch.cuda.synchronize()
    train_time = time.time() - t0
    final_train = ltot.item()
    vl, vcnt = evaluate()
    log(f"# done: steps {step} tokens_seen {tokens} train_time_s {train_time:.1f} "
        f"epochs {tokens / len(train_np):.2f} last_step_train_loss {final_train:.4f}")
    log(f"# final val: loss {vl:.4f} ppl {math.exp(vl):.2f} over {vcnt} tokens "
        f"({(len(val_np) - 1) // T} non-overlapping windows of {T})")
    log(f"# peak GPU memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")

    model.config._attn_implementation = "sdpa"
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config.bos_token_id = 0
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = 1
    model.save_pretrained(args.out, max_shard_size="1GB", safe_serialization=True)
    with open(os.path.join(args.out, "train_summary.json"), "w") as f:
        json.dump({"steps": step, "tokens_seen": tokens, "train_time_s": round(train_time, 1),
                   "final_train_loss": round(final_train, 4), "val_loss": round(vl, 4),
                   "val_ppl": round(math.exp(vl), 3), "val_tokens": vcnt, "params": n_params,
                   "train_tokens_available": int(len(train_np))}, f, indent=1)
    log(f"# saved to {args.out}: {sorted(os.listdir(args.out))}")

    # Loss-curve plot, if matplotlib is present.
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        rows = [l.split("\t") for l in open(args.log) if l[0].isdigit()]
        toks = [int(r[1]) / 1e6 for r in rows]
        losses = [float(r[4]) for r in rows]
        plt.figure(figsize=(7, 4))
        plt.plot(toks, losses, label="train loss")
        plt.axhline(vl, color="r", ls="--", label=f"final val loss {vl:.3f} (ppl {math.exp(vl):.1f})")
        plt.xlabel("tokens seen (M)")
        plt.ylabel("cross-entropy (nats/token)")
        plt.ylim(min(losses) - 0.2, min(max(losses), 8.0))
        plt.title("reference MLA model (DeepseekV3ForCausalLM, 6 layers) on wiki_en")
        plt.grid(alpha=0.3)
        plt.legend()
        plt.tight_layout()
        plt.savefig(os.path.join(os.path.dirname(os.path.abspath(args.log)), "loss_curve.png"), dpi=110)
    except Exception as e:  # noqa: BLE001
        log(f"# no plot: {e!r}")


if __name__ == "__main__":
    main()
