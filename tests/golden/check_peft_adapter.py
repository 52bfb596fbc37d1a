#!/usr/bin/env python3
"""check_peft_adapter.py - does an adapter written by tier give, in HF transformers + PEFT, the logits tier gave?

    python3 tests/golden/check_peft_adapter.py --model MODEL_DIR --adapter ADAPTER_DIR --logits LOGITS.safetensors
            [--key logits] [--ids IDS.safetensors] [--tol 1e-4]

MODEL_DIR     the HF base model (config.json + safetensors) tier trained on
ADAPTER_DIR   adapter_config.json + adapter_model.safetensors as tier wrote them
LOGITS        a safetensors file from tier: "logits" [B, S, V] (or [S, V]) in fp32, and the token ids
              it ran, "input_ids" [B, S] (or [S]; I64 or I32), unless --ids names another file
              holding "input_ids".

The adapter is loaded with peft.PeftModel.from_pretrained (on transformers 5, PEFT converts per-expert
LoRA onto the fused experts), the token ids run through it on the CPU in fp32, and the logits are
compared with tier's. Prints the norm-wise relative error ||a - b|| / ||b||, the largest absolute and
the largest element-wise relative difference. Exit status: 0 when the norm-wise relative error is at
most --tol, 1 on a mismatch, 2 when the files cannot be read.
"""
import argparse, json, os, sys


def load_ids(path):
    from safetensors.torch import load_file
    t = load_file(path)
    if "input_ids" not in t:
        raise SystemExit(f"check_peft_adapter: {path} has no 'input_ids' (use --ids FILE)")
    ids = t["input_ids"].long()
    return ids.unsqueeze(0) if ids.dim() == 1 else ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="HF base model directory")
    ap.add_argument("--adapter", required=True, help="PEFT adapter directory written by tier")
    ap.add_argument("--logits", required=True, help="safetensors file with tier's logits")
    ap.add_argument("--key", default="logits", help="name of the logits tensor in --logits (default logits)")
    ap.add_argument("--ids", help="safetensors file with input_ids (default: the --logits file)")
    ap.add_argument("--tol", type=float, default=1e-4, help="largest norm-wise relative error (default 1e-4)")
    a = ap.parse_args()
    try:
        import torch
        import transformers
        import peft
        from peft import PeftModel
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"check_peft_adapter: {e}; pip install torch transformers peft safetensors", file=sys.stderr)
        return 2
    for p in (os.path.join(a.model, "config.json"), os.path.join(a.adapter, "adapter_config.json"),
              os.path.join(a.adapter, "adapter_model.safetensors"), a.logits):
        if not os.path.exists(p):
            print(f"check_peft_adapter: {p}: no such file", file=sys.stderr)
            return 2
    tl = load_file(a.logits)
    if a.key not in tl:
        print(f"check_peft_adapter: {a.logits} has no '{a.key}' (it holds {sorted(tl)})", file=sys.stderr)
        return 2
    want = tl[a.key].float()
    ids = load_ids(a.ids or a.logits)
    if want.dim() == 2:
        want = want.unsqueeze(0)
    if tuple(want.shape[:2]) != tuple(ids.shape):
        print(f"check_peft_adapter: logits {tuple(want.shape)} do not match input_ids {tuple(ids.shape)}",
              file=sys.stderr)
        return 2

    torch.manual_seed(0)
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["experts_implementation"] = "eager"   # grouped_mm wants 16-byte aligned strides
    try:
        base = AutoModelForCausalLM.from_pretrained(a.model, **kw).eval()
    except (TypeError, ValueError):          # a transformers without experts_implementation
        kw.pop("experts_implementation", None)
        base = AutoModelForCausalLM.from_pretrained(a.model, **kw).eval()
    model = PeftModel.from_pretrained(base, a.adapter).float().eval()
    n_lora = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    with torch.no_grad():
        got = model(input_ids=ids).logits.float()
    if got.shape != want.shape:
        print(f"check_peft_adapter: PEFT's logits are {tuple(got.shape)}, tier's {tuple(want.shape)}", file=sys.stderr)
        return 2
    d = (got.double() - want.double())
    rel = float(d.norm() / want.double().norm())
    max_abs = float(d.abs().max())
    max_rel = float((d.abs() / want.double().abs().clamp_min(1e-6)).max())
    print(f"# torch {torch.__version__} transformers {transformers.__version__} peft {peft.__version__}")
    print(f"# {ids.shape[0]} x {ids.shape[1]} tokens, vocab {want.shape[-1]}, {n_lora} LoRA parameters loaded")
    print(f"logits: rel {rel:.3e}  max abs {max_abs:.3e}  max elementwise rel {max_rel:.3e}  tol {a.tol:g}  "
          f"{'ok' if rel <= a.tol else 'MISMATCH'}")
    return 0 if rel <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
