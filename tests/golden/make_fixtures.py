#!/usr/bin/env python3
"""make_fixtures.py - golden fixtures from HF transformers + PEFT for tier's qwen3_moe and mixtral graphs.

    python3 tests/golden/make_fixtures.py [--out tests/golden/data]

Needs torch, transformers (5.x) and peft (>= 0.21), safetensors, all on the CPU in fp32; runs in a few
seconds and is deterministic (seeded). For each case it writes DATA/<case>/:
    model/     config.json + safetensors as HF's save_pretrained writes them (or hand-converted to
               the fused 3-D expert layout, see CASES)
    adapter/   adapter_config.json + adapter_model.safetensors: a LoRA adapter in PEFT's per-expert
               key layout (the layout tier writes), with random non-zero A and B
    fixture.safetensors  inputs, per-layer hidden states, logits, loss, and the LoRA model's
               logits, loss and every LoRA gradient (see README.md for each key)

The LoRA reference is PEFT itself: the adapter directory is loaded with peft.PeftModel.from_pretrained
(PEFT converts per-expert LoRA onto transformers 5's fused experts), and the result is checked against
an independent merge of B A into the base weights.
"""
import argparse, json, os, shutil, sys

import torch
import transformers
import peft
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import save_file, load_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

B, S = 2, 11                  # batch and sequence length (odd on purpose)
R, ALPHA = 4, 8               # LoRA rank and alpha
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]

CASES = {
    # untied embeddings, norm_topk_prob true, layer 1 dense (mlp_only_layers), per-expert layout, one file
    "qwen3_moe_a": dict(
        cls=Qwen3MoeForCausalLM, layout="per_expert", shard=None, seed=1006,
        cfg=Qwen3MoeConfig(hidden_size=52, intermediate_size=34, moe_intermediate_size=22, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=18, vocab_size=97,
                           num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                           decoder_sparse_step=1, tie_word_embeddings=False, max_position_embeddings=64,
                           rms_norm_eps=1e-6, initializer_range=0.1, router_aux_loss_coef=0.001)),
    # tied embeddings, norm_topk_prob false, k = 3, 5 heads over 1 kv head, experts written fused 3-D
    "qwen3_moe_b": dict(
        cls=Qwen3MoeForCausalLM, layout="fused", shard=None, seed=2032,
        cfg=Qwen3MoeConfig(hidden_size=40, intermediate_size=30, moe_intermediate_size=18, num_hidden_layers=2,
                           num_attention_heads=5, num_key_value_heads=1, head_dim=8, vocab_size=83,
                           num_experts=5, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[],
                           decoder_sparse_step=1, tie_word_embeddings=True, max_position_embeddings=64,
                           rms_norm_eps=1e-6, initializer_range=0.1, router_aux_loss_coef=0.001)),
    # Mixtral layout (block_sparse_moe.experts.E.w1/w2/w3), sharded with model.safetensors.index.json
    "mixtral": dict(
        cls=MixtralForCausalLM, layout="mixtral", shard="120KB", seed=3013,
        cfg=MixtralConfig(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=97, num_local_experts=4, num_experts_per_tok=2,
                          max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.1,
                          tie_word_embeddings=False, router_aux_loss_coef=0.02)),
    # The CUDA path's cases: head_dim 32 (the CUDA attention takes 32, 64, 96 or 128), the other
    # sizes odd. qwen3_moe with a dense layer, per-expert keys; mixtral with 3 heads over 1 kv head.
    "qwen3_moe_c": dict(
        cls=Qwen3MoeForCausalLM, layout="per_expert", shard=None, seed=4079, bf16_ref=True,
        cfg=Qwen3MoeConfig(hidden_size=72, intermediate_size=50, moe_intermediate_size=26, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=101,
                           num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                           decoder_sparse_step=1, tie_word_embeddings=False, max_position_embeddings=64,
                           rms_norm_eps=1e-6, initializer_range=0.1, router_aux_loss_coef=0.001)),
    "mixtral_c": dict(
        cls=MixtralForCausalLM, layout="mixtral", shard=None, seed=5108, bf16_ref=True,
        cfg=MixtralConfig(hidden_size=96, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
                          num_key_value_heads=1, head_dim=32, vocab_size=89, num_local_experts=4,
                          num_experts_per_tok=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                          initializer_range=0.1, tie_word_embeddings=False, router_aux_loss_coef=0.02)),
}


def n_experts(cfg):
    return getattr(cfg, "num_experts", None) or cfg.num_local_experts


def is_moe(cfg, layer):
    if cfg.model_type == "mixtral":
        return True
    return layer not in cfg.mlp_only_layers and (layer + 1) % cfg.decoder_sparse_step == 0


def build_model(case):
    """HF's own init (initializer_range set in the config), then norms pulled away from 1."""
    cfg = case["cfg"]
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"    # the plain per-expert loop; grouped_mm needs 16-byte strides
    torch.manual_seed(case["seed"])
    model = case["cls"](cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def make_inputs(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
    labels = ids.clone()
    labels[0, 0] = labels[0, 5] = labels[1, 3] = labels[1, 10] = -100
    shift = torch.full_like(labels, -100)
    shift[:, :-1] = labels[:, 1:]
    return ids, labels, shift


# ---- Expert layouts ---------------------------------------------------------------------------

def to_fused(model_dir, cfg):
    """Rewrite a per-expert model.safetensors into the fused 3-D layout: mlp.experts.gate_up_proj
    [E, 2I, H] (gate rows first) and mlp.experts.down_proj [E, H, I]."""
    path = os.path.join(model_dir, "model.safetensors")
    sd = load_file(path)
    E = n_experts(cfg)
    for L in range(cfg.num_hidden_layers):
        if not is_moe(cfg, L):
            continue
        pre = f"model.layers.{L}.mlp.experts"
        gate = [sd.pop(f"{pre}.{e}.gate_proj.weight") for e in range(E)]
        up = [sd.pop(f"{pre}.{e}.up_proj.weight") for e in range(E)]
        down = [sd.pop(f"{pre}.{e}.down_proj.weight") for e in range(E)]
        sd[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([g, u], 0) for g, u in zip(gate, up)]).contiguous()
        sd[f"{pre}.down_proj"] = torch.stack(down).contiguous()
    save_file(sd, path, metadata={"format": "pt"})


def expert_key(cfg, L, e, proj):
    if cfg.model_type == "mixtral":
        return f"block_sparse_moe.experts.{e}.{dict(gate_proj='w1', up_proj='w3', down_proj='w2')[proj]}"
    return f"mlp.experts.{e}.{proj}"


# ---- The adapter (PEFT's per-expert key layout, as tier writes it) -------------------------------

def lora_shapes(cfg):
    """(module path under the layer, in, out) of every LoRA target: q/k/v/o everywhere and the
    expert projections of MoE layers. A dense MLP (mlp_only_layers) gets none: PEFT 0.21 on
    transformers 5 maps gate_proj/up_proj/down_proj onto the fused experts only."""
    H, hd = cfg.hidden_size, cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    Q, KV = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    I = cfg.intermediate_size if cfg.model_type == "mixtral" else cfg.moe_intermediate_size
    out = []
    for L in range(cfg.num_hidden_layers):
        out += [(L, "self_attn.q_proj", H, Q), (L, "self_attn.k_proj", H, KV), (L, "self_attn.v_proj", H, KV),
                (L, "self_attn.o_proj", Q, H)]
        if is_moe(cfg, L):
            for e in range(n_experts(cfg)):
                out += [(L, expert_key(cfg, L, e, "gate_proj"), H, I), (L, expert_key(cfg, L, e, "up_proj"), H, I),
                        (L, expert_key(cfg, L, e, "down_proj"), I, H)]
    return out


def lora_key(L, module, half):
    return f"base_model.model.model.layers.{L}.{module}.lora_{half}.weight"


def write_adapter(adir, cfg, tensors):
    targets = ATTN + (["w1", "w2", "w3"] if cfg.model_type == "mixtral" else ["gate_proj", "up_proj", "down_proj"])
    conf = {"alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": None, "bias": "none",
            "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True, "layer_replication": None,
            "layers_pattern": None, "layers_to_transform": None, "loftq_config": {}, "lora_alpha": ALPHA,
            "lora_dropout": 0.0, "megatron_config": None, "megatron_core": "megatron.core",
            "modules_to_save": None, "peft_type": "LORA", "r": R, "rank_pattern": {}, "revision": None,
            "target_modules": targets, "task_type": "CAUSAL_LM", "use_dora": False, "use_rslora": False}
    os.makedirs(adir, exist_ok=True)
    with open(os.path.join(adir, "adapter_config.json"), "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(adir, "adapter_model.safetensors"),
              metadata={"format": "pt"})


def random_adapter(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    t = {}
    for L, mod, fin, fout in lora_shapes(cfg):
        t[lora_key(L, mod, "A")] = torch.randn(R, fin, generator=g) / fin ** 0.5
        t[lora_key(L, mod, "B")] = 0.5 * torch.randn(fout, R, generator=g) / R ** 0.5
    return t


def load_peft(model_dir, adir):
    base = load_base(model_dir)
    pm = PeftModel.from_pretrained(base, adir, is_trainable=True)
    return pm.float().eval()


def load_base(model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    cls = MixtralForCausalLM if cfg["model_type"] == "mixtral" else Qwen3MoeForCausalLM
    return cls.from_pretrained(model_dir, attn_implementation="eager",
                               experts_implementation="eager", dtype=torch.float32).eval()


def lora_params(pm):
    return {n: p for n, p in pm.named_parameters() if ".lora_" in n}


def gather_map(model_dir, cfg, tmp):
    """Where each element of each per-expert LoRA tensor lands inside PEFT's (possibly fused)
    parameters: load an adapter whose elements are their own 1-based global index and read the
    parameters back. Returns {peft param name: (flat positions, global indices)} and the key order."""
    shapes = {}
    for L, mod, fin, fout in lora_shapes(cfg):
        shapes[lora_key(L, mod, "A")] = (R, fin)
        shapes[lora_key(L, mod, "B")] = (fout, R)
    keys = sorted(shapes)
    tags, base = {}, 1
    for k in keys:
        n = shapes[k][0] * shapes[k][1]
        tags[k] = torch.arange(base, base + n, dtype=torch.float32).reshape(shapes[k])
        base += n
    assert base < 2 ** 24, "tags must be exact in fp32"
    write_adapter(tmp, cfg, tags)
    pm = load_peft(model_dir, tmp)
    where, seen = {}, torch.zeros(base, dtype=torch.int64)
    for name, p in lora_params(pm).items():
        v = p.detach().reshape(-1)
        pos = torch.nonzero(v).reshape(-1)
        idx = v[pos].round().long()
        assert torch.equal(v[pos], idx.float()), f"{name}: PEFT changed the tags (scaling applied to weights?)"
        seen.index_add_(0, idx, torch.ones_like(idx))
        where[name] = (pos, idx)
    assert seen[0] == 0 and bool((seen[1:] == 1).all()), "per-expert LoRA elements must map one to one"
    starts, base = {}, 1
    for k in keys:
        starts[k] = base
        base += shapes[k][0] * shapes[k][1]
    return where, keys, shapes, starts


# ---- Forward passes -----------------------------------------------------------------------------

def run(model, ids, labels, inner):
    """Logits, loss (mean over counted tokens, no aux loss) and hidden states by hooks: the
    embeddings, each decoder layer's output (before the final norm), the final norm's output, and
    inside each layer the attention's input (after input_layernorm) and output (after o_proj), the
    MLP block's input (after post_attention_layernorm) and output (before the residual add)."""
    caught = {}
    hooks = [inner.embed_tokens.register_forward_hook(lambda m, i, o: caught.__setitem__("embed", o)),
             inner.norm.register_forward_hook(lambda m, i, o: caught.__setitem__("final_norm", o))]
    def keep(key):
        return lambda m, i, o: caught.__setitem__(key, o[0] if isinstance(o, tuple) else o)
    for L, layer in enumerate(inner.layers):
        hooks += [layer.register_forward_hook(keep(f"layer.{L}")),
                  layer.input_layernorm.register_forward_hook(keep(f"attn_in.{L}")),
                  layer.self_attn.register_forward_hook(keep(f"attn_out.{L}")),
                  layer.post_attention_layernorm.register_forward_hook(keep(f"mlp_in.{L}")),
                  layer.mlp.register_forward_hook(keep(f"mlp_out.{L}"))]
    out = model(input_ids=ids, labels=labels, output_hidden_states=True, output_router_logits=False)
    for h in hooks:
        h.remove()
    return out, caught


def check_hf_hidden(out, caught, nl):
    """Pin down what HF's output_hidden_states holds (so README.md can say it): index 0 is the
    embeddings, index i (1 <= i < L) layer i-1's output, index L the final norm's output."""
    hs = out.hidden_states
    assert len(hs) == nl + 1
    assert torch.equal(hs[0], caught["embed"])
    for i in range(1, nl):
        assert torch.equal(hs[i], caught[f"layer.{i - 1}"])
    assert torch.equal(hs[nl], caught["final_norm"]), "HF's last hidden state is expected after the final norm"


def topk_margin(out_rl, k):
    """Smallest gap between the k-th and (k+1)-th router probability over tokens and MoE layers:
    a routing decision this close could flip under rounding."""
    m = float("inf")
    for rl in out_rl:
        p = torch.softmax(rl.double(), -1).sort(-1, descending=True).values
        m = min(m, float((p[:, k - 1] - p[:, k]).min()))
    return m


def merged_reference(model_dir, cfg, adapter, ids, labels):
    """Independent LoRA reference: W + (alpha / r) B A merged into the per-expert weights."""
    base = load_base(model_dir)
    sd = {k: v.clone() for k, v in base.state_dict().items()}
    s = ALPHA / R
    for L, mod, fin, fout in lora_shapes(cfg):
        delta = s * adapter[lora_key(L, mod, "B")] @ adapter[lora_key(L, mod, "A")]
        if mod.startswith("self_attn"):
            sd[f"model.layers.{L}.{mod}.weight"] += delta
            continue
        e = int(mod.split(".")[2])
        leaf = mod.split(".")[3]
        I = delta.shape[0] if leaf in ("gate_proj", "up_proj", "w1", "w3") else delta.shape[1]
        gu, dn = f"model.layers.{L}.mlp.experts.gate_up_proj", f"model.layers.{L}.mlp.experts.down_proj"
        if leaf in ("gate_proj", "w1"):
            sd[gu][e, :I] += delta
        elif leaf in ("up_proj", "w3"):
            sd[gu][e, I:] += delta
        else:
            sd[dn][e] += delta
    base.load_state_dict(sd)
    with torch.no_grad():
        return base(input_ids=ids, labels=labels)


def save_sorted(tensors, path, metadata):
    """safetensors with the header's keys in sorted order (the package's writer orders
    __metadata__ by hash, so the same data would give different bytes from run to run)."""
    names = {torch.float32: "F32", torch.int64: "I64"}
    header, blobs, off = {"__metadata__": dict(sorted(metadata.items()))}, [], 0
    for k in sorted(tensors):
        t = tensors[k]
        b = t.numpy().tobytes()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(len(h).to_bytes(8, "little") + h + b"".join(blobs))


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def bf16_round(t):
    return t.to(torch.bfloat16).to(torch.float32)


def bf16_reference(cdir, mdir, cfg, adapter, ids, labels, gmap):
    """The CUDA path stores the base weights in bf16 and multiplies with bf16 copies of LoRA A and
    B. This is HF + PEFT in fp32 on exactly those values (weights and adapter rounded to bf16), so
    a comparison with it measures the trainer's arithmetic, not the storage format: keys bf16w.*
    (loss, hidden.L, final_norm, logits, lora.loss, lora.hidden.L, lora.logits, grad.<key>)."""
    where, keys, shapes, starts = gmap
    rdir, radir = os.path.join(cdir, "bf16.tmp"), os.path.join(cdir, "bf16a.tmp")
    m = load_base(mdir)
    with torch.no_grad():
        for _, prm in m.named_parameters():
            prm.copy_(bf16_round(prm))
    m.save_pretrained(rdir, safe_serialization=True)
    write_adapter(radir, cfg, {k: bf16_round(v) for k, v in adapter.items()})
    fx, nl = {}, cfg.num_hidden_layers
    base = load_base(rdir)
    with torch.no_grad():
        out, caught = run(base, ids, labels, base.model)
    fx["bf16w.loss"], fx["bf16w.logits"] = out.loss.reshape(1), out.logits
    fx["bf16w.hidden.0"], fx["bf16w.final_norm"] = caught["embed"], caught["final_norm"]
    for L in range(nl):
        fx[f"bf16w.hidden.{L + 1}"] = caught[f"layer.{L}"]
    pm = load_peft(rdir, radir)
    lout, lcaught = run(pm, ids, labels, pm.base_model.model.model)
    lout.loss.backward()
    flat_g = torch.zeros(starts[keys[-1]] + shapes[keys[-1]][0] * shapes[keys[-1]][1])
    for pname, prm in lora_params(pm).items():
        pos, idx = where[pname]
        flat_g[idx] = prm.grad.reshape(-1)[pos]
    for k in keys:
        n = shapes[k][0] * shapes[k][1]
        fx[f"bf16w.grad.{k}"] = flat_g[starts[k]:starts[k] + n].reshape(shapes[k]).clone()
    fx["bf16w.lora.loss"], fx["bf16w.lora.logits"] = lout.loss.detach().reshape(1), lout.logits.detach()
    for L in range(nl):
        fx[f"bf16w.lora.hidden.{L + 1}"] = lcaught[f"layer.{L}"].detach()
    shutil.rmtree(rdir)
    shutil.rmtree(radir)
    fx.update(hf_bf16(mdir, os.path.join(cdir, "adapter"), cfg, ids, labels, gmap))
    return fx


def hf_bf16(mdir, adir, cfg, ids, labels, gmap):
    """HF + PEFT's own bf16 training arithmetic (model and adapter cast to bf16, as torch runs a
    bf16 model): keys hfbf16.* (lora.loss, lora.logits, grad.<key>), stored in fp32. Its distance
    from the fp32 fixture is what bf16 costs HF itself; test_golden_cuda holds tier's CUDA path
    to the same scale for the gradients (FlashAttention's test method)."""
    where, keys, shapes, starts = gmap
    pm = load_peft(mdir, adir).to(torch.bfloat16)
    out = pm(input_ids=ids, labels=labels)
    out.loss.backward()
    flat_g = torch.zeros(starts[keys[-1]] + shapes[keys[-1]][0] * shapes[keys[-1]][1])
    for pname, prm in lora_params(pm).items():
        pos, idx = where[pname]
        flat_g[idx] = prm.grad.float().reshape(-1)[pos]
    fx = {"hfbf16.lora.loss": out.loss.detach().float().reshape(1), "hfbf16.lora.logits": out.logits.detach().float()}
    for k in keys:
        n = shapes[k][0] * shapes[k][1]
        fx[f"hfbf16.grad.{k}"] = flat_g[starts[k]:starts[k] + n].reshape(shapes[k]).clone()
    return fx


def make_case(name, case, root):
    cfg = case["cfg"]
    cdir = os.path.join(root, name)
    mdir, adir = os.path.join(cdir, "model"), os.path.join(cdir, "adapter")
    shutil.rmtree(cdir, ignore_errors=True)
    os.makedirs(cdir)
    model = build_model(case)
    model.save_pretrained(mdir, safe_serialization=True, **({"max_shard_size": case["shard"]} if case["shard"] else {}))
    if os.path.exists(os.path.join(mdir, "generation_config.json")):
        os.remove(os.path.join(mdir, "generation_config.json"))
    if case["layout"] == "fused":
        to_fused(mdir, cfg)
    ids, labels, shift = make_inputs(cfg, case["seed"] + 1)
    fx = {"input_ids": ids, "labels": labels, "shift_labels": shift}

    # The base model as reloaded from disk (so the fixtures describe the files), checked against memory.
    base = load_base(mdir)
    with torch.no_grad():
        out, caught = run(base, ids, labels, base.model)
        mem = model(input_ids=ids, labels=labels)
        aux = base(input_ids=ids, labels=labels, output_router_logits=True)
    assert torch.equal(mem.logits, out.logits), f"{name}: the saved model differs from the one in memory"
    check_hf_hidden(out, caught, cfg.num_hidden_layers)
    nl = cfg.num_hidden_layers
    fx["hidden.0"] = caught["embed"]
    for L in range(nl):
        fx[f"hidden.{L + 1}"] = caught[f"layer.{L}"]
    fx["final_norm"] = caught["final_norm"]
    for L in range(nl):
        for k in ("attn_in", "attn_out", "mlp_in", "mlp_out"):
            fx[f"{k}.{L}"] = caught[f"{k}.{L}"]
    fx["logits"] = out.logits
    fx["loss"] = out.loss.reshape(1)
    fx["aux_loss"] = aux.aux_loss.reshape(1)
    moe_layers = [L for L in range(nl) if is_moe(cfg, L)]
    for L, rl in zip(moe_layers, aux.router_logits):
        fx[f"router_logits.{L}"] = rl
    margin = topk_margin(aux.router_logits, cfg.num_experts_per_tok)

    # LoRA: the adapter on disk, loaded by PEFT; gradients mapped back to per-expert keys.
    where, keys, shapes, starts = gather_map(mdir, cfg, os.path.join(cdir, "tags.tmp"))
    shutil.rmtree(os.path.join(cdir, "tags.tmp"))
    adapter = random_adapter(cfg, case["seed"] + 2)
    write_adapter(adir, cfg, adapter)
    pm = load_peft(mdir, adir)
    lout, lcaught = run(pm, ids, labels, pm.base_model.model.model)
    lout.loss.backward()
    with torch.no_grad():
        lrl = pm(input_ids=ids, output_router_logits=True).router_logits
    margin = min(margin, topk_margin(lrl, cfg.num_experts_per_tok))
    assert margin > 1e-3, f"{name}: top-k routing margin {margin:.2e} too small; change the seed"
    flat_w = torch.zeros(starts[keys[-1]] + shapes[keys[-1]][0] * shapes[keys[-1]][1])
    flat_g = torch.zeros_like(flat_w)
    for pname, p in lora_params(pm).items():
        pos, idx = where[pname]
        flat_w[idx] = p.detach().reshape(-1)[pos]
        flat_g[idx] = p.grad.reshape(-1)[pos]
    for k in keys:
        n = shapes[k][0] * shapes[k][1]
        w = flat_w[starts[k]:starts[k] + n].reshape(shapes[k])
        assert torch.equal(w, adapter[k]), f"{name}: {k} did not load into PEFT as written"
        fx[f"grad.{k}"] = flat_g[starts[k]:starts[k] + n].reshape(shapes[k]).clone()
    fx["lora.logits"] = lout.logits.detach()
    fx["lora.loss"] = lout.loss.detach().reshape(1)
    for L in range(nl):
        fx[f"lora.hidden.{L + 1}"] = lcaught[f"layer.{L}"].detach()
        fx[f"lora.mlp_in.{L}"] = lcaught[f"mlp_in.{L}"].detach()
        fx[f"lora.mlp_out.{L}"] = lcaught[f"mlp_out.{L}"].detach()
    ref = merged_reference(mdir, cfg, adapter, ids, labels)
    e_ref = rel(lout.logits.detach(), ref.logits)
    assert e_ref < 1e-5, f"{name}: PEFT's LoRA logits differ from merged weights by {e_ref:.2e}"
    assert rel(lout.logits.detach(), out.logits) > 1e-2, f"{name}: the adapter hardly changes the logits"
    if case.get("bf16_ref"):
        fx.update(bf16_reference(cdir, mdir, cfg, adapter, ids, labels, (where, keys, shapes, starts)))
        errs = sorted(rel(fx[f"hfbf16.grad.{k}"], fx[f"grad.{k}"]) for k in keys if fx[f"grad.{k}"].norm() > 0)
        print(f"{name}: HF bf16 vs fp32: lora logits {rel(fx['hfbf16.lora.logits'], fx['lora.logits']):.2e}, "
              f"LoRA gradients median {errs[len(errs) // 2]:.2e} max {errs[-1]:.2e}")

    save_sorted({k: v.detach().contiguous() for k, v in fx.items()}, os.path.join(cdir, "fixture.safetensors"),
                metadata={"format": "pt", "case": name, "transformers": transformers.__version__,
                        "peft": peft.__version__, "torch": torch.__version__, "lora_r": str(R),
                        "lora_alpha": str(ALPHA), "topk_margin": f"{margin:.3e}"})
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cdir) for f in fs)
    print(f"{name:12s} layout {case['layout']:10s} loss {out.loss.item():.6f} aux {aux.aux_loss.item():.6f} "
          f"lora loss {lout.loss.item():.6f} lora-vs-merged {e_ref:.1e} margin {margin:.1e} "
          f"{len(keys)} LoRA tensors {size / 1024:.0f} KiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "data"))
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases")
    a = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    print(f"# torch {torch.__version__} transformers {transformers.__version__} peft {peft.__version__}")
    if int(transformers.__version__.split(".")[0]) < 5:
        sys.exit("transformers 5.x is needed (the fused-expert PEFT path); found " + transformers.__version__)
    for name in a.case or sorted(CASES):
        make_case(name, CASES[name], a.out)


if __name__ == "__main__":
    main()
