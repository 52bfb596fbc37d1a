#!/usr/bin/env python3
"""train_torch.py - the peer of tier's trainer benchmark: LoRA fine-tuning throughput of HF transformers + PEFT
on a model with the shape of Qwen3-30B-A3B (48 layers, hidden 2048, 128 experts of 768, 8 per token, 32 query /
4 KV heads of 128, vocab 151936, untied lm_head), built from a config with random weights in bf16 directly on the
GPU (no hub, no checkpoint), trained on random tokens of length 4096 (labels = inputs).

What one run does: builds the model (from_config under `with torch.device("cuda")`, dtype bf16, attention "sdpa",
experts "grouped_mm" - transformers 5 keeps a Qwen3-MoE layer's experts as two fused 3-D parameters,
mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I], and runs them through
torch grouped_mm), wraps it with peft.get_peft_model(LoraConfig(r=16, alpha=32, dropout=0)) on
  --targets attn           q_proj, k_proj, v_proj, o_proj
  --targets attn+experts   the same plus the experts' fused parameters through LoraConfig(target_parameters=
                           ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]) - PEFT's ParamWrapper, which gives
                           each expert its own rank-r pair and, on every forward, folds W + s*B@A into a full copy of
                           the expert stack (one baddbmm) that grouped_mm then uses; the backward so computes the
                           experts' dense weight gradient too (the FLOPs of a full fine-tune's weight gradient), which
                           the MFU below does not count, and autograd keeps each layer's folded stack (1.2 GB in bf16
                           at this shape, 58 GB over 48 layers, beside the 61 GB of weights) for the backward unless
                           --gradient-checkpointing recomputes it: without it batch 1 at seq 4096 may not fit,
then trains with torch AdamW (lr 1e-4) over the LoRA parameters only: forward with labels (the model's own
shifted cross-entropy), backward, step, zero_grad. --batch auto (the default) tries 1, 2, 4, ... and keeps the
largest batch whose step runs without CUDA OOM; then --warmup steps, then --steps timed steps between
torch.cuda.synchronize() calls. The first step checks that the LoRA B matrices got non-zero gradients and are
non-zero after the step (and, with attn+experts, that the expert adapters did too); a failed check is an error.

Output: human-readable lines on stderr, and one JSON line on stdout:
  tokens_per_s  batch * seq * steps / time of the timed steps
  step_s        time of one optimizer step (forward + backward + AdamW) at that batch
  active_params the parameters one token goes through, from the config (formula at active_params())
  mfu           4 * active_params * tokens_per_s / 989e12: forward (2N) + input gradient (2N) per token, against
                the H200's dense bf16 peak (no sparsity). LoRA's own FLOPs, attention's score/value products and
                PEFT's dense expert weight gradient are not counted: a useful-work rate, the same count for any
                engine on this model, not the GPU's busy rate
  peak_gb       torch.cuda.max_memory_allocated over the warm-up and timed steps (model weights included)
  trainable_params  the LoRA parameters (requires_grad; PEFT keeps them in fp32 by default: "lora_dtype"); with
                attn+experts "expert_lora_params" is the experts' share (rank r per expert: r*E*(H+2I) + r*E*(I+H)
                a layer)
On failure (no CUDA, PEFT unable to target the experts, OOM at batch 1, a failed check) the JSON line has "error"
with the exception text and the exit status is 1 (2 for no CUDA).

On the GPU machine (torch 2.11, transformers 5.17, peft 0.21; no internet, nothing is downloaded):
  python3 bench/train_torch.py --targets attn
  python3 bench/train_torch.py --targets attn+experts [--gradient-checkpointing] [--batch N] [--layers N]
A logic check on a CPU (a 2-layer, hidden-64, 8-expert config, seq 64):
  python3 bench/train_torch.py --tiny --device cpu --steps 2 --warmup 1 --targets attn+experts
"""
import argparse
import gc
import json
import math
import os
import sys
import time

# fewer OOMs from fragmentation while --batch auto probes and between steps; set before CUDA starts, reported
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
try:
    import torch
except ImportError:
    print("train_torch.py: needs torch, transformers and peft (pip install torch transformers peft)", file=sys.stderr)
    sys.exit(2)

PEAK_FLOPS = 989e12  # H200 (H100 SXM class) dense BF16 tensor-core peak, without 2:4 sparsity
ATTN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, num_experts=128, moe_intermediate_size=768, num_experts_per_tok=8,
    norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=40960,
    seq=4096)
TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, moe_intermediate_size=32, num_experts_per_tok=2,
    norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, max_position_embeddings=256,
    seq=64)


KEY_ORDER = ["peer", "transformers", "peft", "torch", "layers", "seq", "batch", "targets", "tokens_per_s", "step_s",
             "mfu", "peak_gb", "active_params", "trainable_params", "device"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def emit(out):
    """The one JSON line on stdout: the fixed keys first, then the rest."""
    d = {k: out[k] for k in KEY_ORDER if k in out}
    d.update((k, v) for k, v in out.items() if k not in d)
    print(json.dumps(d), flush=True)


def fmt_n(n):
    return f"{n / 1e9:.3f}e9" if n >= 1e8 else f"{n:,}"


def active_params(s):
    """Parameters one token goes through, from the shape dict s:
        V*H (embedding) + V*H (lm_head, untied) + H (final norm)
      + L * [ H*(nq*d) + 2*H*(nkv*d) + (nq*d)*H      q, k, v, o projections (no bias)
              + 2*d                                 q_norm, k_norm
              + 2*H                                 input and post-attention RMSNorm
              + E*H                                 router
              + k*3*H*I ]                           k experts' gate, up and down (I = moe_intermediate_size)
    Qwen3-30B-A3B: 2 * 311.16M + 2048 + 48 * 56.89M = 3.353e9 (of 30.53e9 in all)."""
    H, V, L, d = s["hidden_size"], s["vocab_size"], s["num_hidden_layers"], s["head_dim"]
    nq, nkv, E, k, I = (s["num_attention_heads"], s["num_key_value_heads"], s["num_experts"],
                        s["num_experts_per_tok"], s["moe_intermediate_size"])
    attn = H * nq * d + 2 * H * nkv * d + nq * d * H + 2 * d
    layer = attn + 2 * H + E * H + k * 3 * H * I
    return 2 * V * H + H + L * layer


def is_oom(e):
    if isinstance(e, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)):
        return True
    msg = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in msg or "CUBLAS_STATUS_ALLOC_FAILED" in msg)


class FakeOOM(RuntimeError):
    """Raised instead of a real OOM above TRAIN_TORCH_FAKE_OOM_ABOVE (a batch size) to test --batch auto on a CPU."""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", choices=["attn", "attn+experts"], default="attn")
    ap.add_argument("--batch", default="auto", help="sequences per step, or auto (largest power of 2 that fits)")
    ap.add_argument("--max-batch", type=int, help="upper bound for --batch auto (default 64 on CUDA, 4 on a CPU)")
    ap.add_argument("--seq", type=int, help="sequence length (default 4096; 64 with --tiny)")
    ap.add_argument("--layers", type=int, help="decoder layers (default 48; 2 with --tiny)")
    ap.add_argument("--tiny", action="store_true", help="a small config that runs on a CPU (a logic check)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (default sdpa)")
    ap.add_argument("--experts", default="grouped_mm",
                    help="experts_implementation: grouped_mm (default), batched_mm or eager")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    out = {"peer": "hf-transformers+peft", "torch": torch.__version__}
    if a.steps < 1 or a.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if a.batch != "auto" and not (a.batch.isdigit() and int(a.batch) > 0):
        ap.error(f"--batch needs a positive integer or auto, not '{a.batch}'")

    if a.device == "auto":
        dev = "cuda" if torch.cuda.is_available() else ("cpu" if a.tiny else None)
    else:
        dev = a.device
    if dev is None or (dev == "cuda" and not torch.cuda.is_available()):
        msg = "no CUDA device (torch.cuda.is_available() is False); use --tiny or --device cpu for a CPU check"
        log("train_torch.py: " + msg)
        out["error"] = msg
        emit(out)
        sys.exit(2)
    out["device"] = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    if a.max_batch is None:
        a.max_batch = 64 if dev == "cuda" else 4
    if dev == "cuda":
        out["alloc_conf"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")

    try:
        run(a, dev, out)
    except Exception as e:  # report every failure as JSON, not only as a traceback
        import traceback
        traceback.print_exc()
        out["error"] = f"{type(e).__name__}: {e}"
        emit(out)
        sys.exit(1)
    emit(out)


def build_model(a, dev, s, out):
    import transformers
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], intermediate_size=s["intermediate_size"],
        num_hidden_layers=s["num_hidden_layers"], num_attention_heads=s["num_attention_heads"],
        num_key_value_heads=s["num_key_value_heads"], head_dim=s["head_dim"], num_experts=s["num_experts"],
        moe_intermediate_size=s["moe_intermediate_size"], num_experts_per_tok=s["num_experts_per_tok"],
        norm_topk_prob=s["norm_topk_prob"], rms_norm_eps=s["rms_norm_eps"],
        rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
        tie_word_embeddings=s["tie_word_embeddings"],
        max_position_embeddings=max(s["max_position_embeddings"], s["seq"]),
        decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False, use_cache=False)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    t0 = time.perf_counter()
    # Built on the device itself: parameters are allocated (and initialised by transformers' _init_weights, normal_
    # on the device) where they live, never on the CPU. transformers 5 takes dtype= (torch_dtype= is deprecated).
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=a.attn,
                                                 experts_implementation=a.experts)
    if dev == "cuda":
        torch.cuda.synchronize()
    t_init = time.perf_counter() - t0
    # the config must have given the shape asked for (head_dim is not hidden/heads in Qwen3-30B-A3B)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj.out_features == s["num_attention_heads"] * s["head_dim"], "head_dim not applied"
    assert tuple(layer.mlp.experts.gate_up_proj.shape) == (
        s["num_experts"], 2 * s["moe_intermediate_size"], s["hidden_size"]), "unexpected expert layout"
    assert next(model.parameters()).device.type == dev
    total = sum(p.numel() for p in model.parameters())
    out["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    out["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    log(f"model: {type(model).__name__}, {s['num_hidden_layers']} layers, {fmt_n(total)} parameters "
        f"({dtype}, {dev}), built and initialised in {t_init:.1f} s; attention {out['attn_implementation']}, "
        f"experts {out['experts_implementation']}; transformers {transformers.__version__}")
    out["init_s"] = round(t_init, 2)
    out["total_params"] = total
    return model


def apply_lora(a, model, out):
    import peft
    from peft import LoraConfig, get_peft_model

    kw = dict(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, bias="none", target_modules=list(ATTN_TARGETS))
    if a.targets == "attn+experts":
        # PEFT >= 0.17: LoRA on bare nn.Parameters (fused MoE experts) through target_parameters; the names are
        # matched as suffixes of the full parameter names (model.layers.N.mlp.experts.gate_up_proj).
        kw["target_parameters"] = list(EXPERT_TARGETS)
    try:
        cfg = LoraConfig(**kw)
        model = get_peft_model(model, cfg)
    except Exception as e:
        if a.targets == "attn+experts":
            raise RuntimeError(f"peft {peft.__version__} could not put LoRA on the fused expert parameters "
                               f"{EXPERT_TARGETS}: {type(e).__name__}: {e}") from e
        raise
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_expert = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".experts" in n)
    bad = [n for n in names if "lora_" not in n]
    assert not bad, f"non-LoRA parameters are trainable: {bad[:4]}"
    if a.targets == "attn+experts" and n_expert == 0:
        raise RuntimeError(f"peft {peft.__version__}: target_parameters={EXPERT_TARGETS} gave no expert adapter")
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.requires_grad})
    log(f"LoRA r={a.rank} alpha={a.alpha} on {a.targets}: {trainable:,} trainable parameters "
        f"({n_expert:,} in expert adapters) in {len(names)} tensors, dtype {'/'.join(dtypes)}; peft {peft.__version__}")
    out["trainable_params"] = trainable
    out["expert_lora_params"] = n_expert
    out["lora_dtype"] = "/".join(dtypes)
    return model


def run(a, dev, out):
    import transformers
    import peft

    out["transformers"] = transformers.__version__
    out["peft"] = peft.__version__
    s = dict(TINY if a.tiny else QWEN3_30B_A3B)
    if a.layers is not None:
        if a.layers < 1:
            raise ValueError("--layers must be >= 1")
        s["num_hidden_layers"] = a.layers
    if a.seq is not None:
        s["seq"] = a.seq
    seq, vocab = s["seq"], s["vocab_size"]
    out.update(config="tiny" if a.tiny else "qwen3-30b-a3b", layers=s["num_hidden_layers"], seq=seq,
               targets=a.targets, gradient_checkpointing=bool(a.gradient_checkpointing), dtype=a.dtype)
    N = active_params(s)
    out["active_params"] = N
    torch.manual_seed(a.seed)

    model = build_model(a, dev, s, out)
    if a.gradient_checkpointing:
        # non-reentrant: works with frozen embeddings (no enable_input_require_grads needed)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = apply_lora(a, model, out)
    model.train()
    log(f"gradient checkpointing: {'on' if a.gradient_checkpointing else 'off'}")

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr)
    lora_b = [(n, p) for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n]
    fake_oom_above = int(os.environ.get("TRAIN_TORCH_FAKE_OOM_ABOVE", "0"))
    state = {"checked": False}

    def check(when, tensors):
        nz = [n for n, t in tensors if t is not None and bool((t != 0).any())]
        if not nz:
            raise AssertionError(f"no LoRA B {when} is non-zero after the first step")
        if a.targets == "attn+experts" and not any(".experts" in n for n in nz):
            raise AssertionError(f"no expert LoRA B {when} is non-zero after the first step")
        return len(nz)

    def step(batch):
        if fake_oom_above and batch > fake_oom_above:
            raise FakeOOM("out of memory (TRAIN_TORCH_FAKE_OOM_ABOVE)")
        ids = torch.randint(0, vocab, (batch, seq), device=dev)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        first = not state["checked"]
        if first:
            ng = check("gradient", [(n, p.grad) for n, p in lora_b])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if first:
            nb = check("weight", [(n, p.detach()) for n, p in lora_b])
            state["checked"] = True
            log(f"check: {ng} of {len(lora_b)} LoRA B tensors got a non-zero gradient and {nb} are non-zero "
                f"after the first step; loss {loss.item():.4f} (ln V = {math.log(vocab):.4f})")
        return loss.detach()

    def free():
        opt.zero_grad(set_to_none=True)
        gc.collect()
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    if a.batch == "auto":
        batch, b = 0, 1
        while b <= a.max_batch:
            t0 = time.perf_counter()
            ok = True
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                step(b)
                if dev == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:
                if not (is_oom(e) or isinstance(e, FakeOOM)):
                    raise
                ok = False
                msg = str(e).split("\n")[0][:160]
            free()
            if not ok:
                log(f"batch {b}: out of memory ({msg})")
                break
            peak = f", peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB" if dev == "cuda" else ""
            log(f"batch {b}: a step ran in {time.perf_counter() - t0:.2f} s{peak}")
            batch, b = b, b * 2
        if batch == 0:
            raise RuntimeError(f"out of memory at batch 1 (seq {seq}, {s['num_hidden_layers']} layers); "
                               "try --gradient-checkpointing or --layers")
        log(f"batch auto: {batch}")
        out["batch_auto"] = True
    else:
        batch = int(a.batch)

    def measure(batch):
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(a.warmup):
            step(batch)
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = step(batch)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, loss

    while True:
        try:
            dt, loss = measure(batch)
            break
        except Exception as e:
            # a batch that fit once may not fit again (fragmentation): with --batch auto, halve it and go on
            if not (a.batch == "auto" and batch > 1 and (is_oom(e) or isinstance(e, FakeOOM))):
                raise
            msg = str(e).split("\n")[0][:160]
        free()
        log(f"batch {batch}: out of memory in the timed run ({msg}); trying {batch // 2}")
        batch //= 2
    out["batch"] = batch

    tokens = batch * seq * a.steps
    tps = tokens / dt
    out["tokens_per_s"] = round(tps, 1)
    out["step_s"] = round(dt / a.steps, 4)
    out["mfu"] = float(f"{4 * N * tps / PEAK_FLOPS:.4g}")
    out["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2) if dev == "cuda" else None
    out["loss"] = round(loss.item(), 4)
    out["warmup"], out["steps"] = a.warmup, a.steps
    log(f"{a.steps} steps of batch {batch} x seq {seq}: {dt / a.steps:.3f} s a step, {tps:,.0f} tokens/s, "
        f"MFU {out['mfu'] * 100:.1f}% (4 x {fmt_n(N)} active x tokens/s / 989 TFLOP/s), "
        + (f"peak {out['peak_gb']} GB, " if dev == "cuda" else "") + f"loss {out['loss']}")


if __name__ == "__main__":
    main()
