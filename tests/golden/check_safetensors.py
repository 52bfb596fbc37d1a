#!/usr/bin/env python3
"""check_safetensors.py - cross-check tier's safetensors reader and writer against the reference
`safetensors` Python package (pip install safetensors numpy). Not part of CI: run by hand.

    python3 tests/golden/check_safetensors.py --lib BUILD/.libs/libtier.so [--corpus DIR ...]

1. tier writes random tensors of every dtype; the reference reads them back (bytes, shapes, dtypes,
   metadata must match).
2. The reference writes random tensors; tier reads them back the same way.
3. Differential: every file in the corpus directories is given to both parsers; they must agree on
   accept/reject (the fuzz corpus is a good input). Exit status 0 when everything agrees.
"""
import argparse, ctypes, os, random, sys, tempfile

import numpy as np
import safetensors
from safetensors import safe_open

DTYPES = ["F32", "BF16", "F16", "F64", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8",
          "U64", "U32", "U16", "U8", "BOOL"]                  # tier_dtype order
SIZES = dict(F32=4, BF16=2, F16=2, F64=8, F8_E4M3=1, F8_E5M2=1, I64=8, I32=4, I16=2, I8=1,
             U64=8, U32=4, U16=2, U8=1, BOOL=1)
PYNAME = dict(F32="float32", BF16="bfloat16", F16="float16", F64="float64", F8_E4M3="float8_e4m3fn",
              F8_E5M2="float8_e5m2", I64="int64", I32="int32", I16="int16", I8="int8", U64="uint64",
              U32="uint32", U16="uint16", U8="uint8", BOOL="bool")


class Tensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_uint64 * 8), ("offset", ctypes.c_uint64), ("nbytes", ctypes.c_uint64)]


class WTensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_int), ("ndim", ctypes.c_int),
                ("shape", ctypes.c_uint64 * 8), ("data", ctypes.c_void_p)]


def load_lib(path):
    lib = ctypes.CDLL(path)
    lib.tier_st_open.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.tier_st_parse_header.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint64,
                                         ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.tier_st_close.argtypes = [ctypes.c_void_p]
    lib.tier_st_count.argtypes = [ctypes.c_void_p]
    lib.tier_st_count.restype = ctypes.c_size_t
    lib.tier_st_at.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib.tier_st_at.restype = ctypes.POINTER(Tensor)
    lib.tier_st_read.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.tier_st_metadata.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.tier_st_metadata.restype = ctypes.c_char_p
    lib.tier_st_write.argtypes = [ctypes.c_char_p, ctypes.POINTER(WTensor), ctypes.c_size_t,
                                  ctypes.POINTER(ctypes.c_char_p)]
    lib.tier_last_error.restype = ctypes.c_char_p
    return lib


def random_tensors(rng):
    out = {}
    for i, dt in enumerate(DTYPES * 2):
        ndim = rng.randrange(4)
        shape = [rng.randrange(0 if (i == 3 and d == 0) else 1, 6) for d in range(ndim)]
        n = int(np.prod(shape)) if shape else 1
        data = bytes(rng.getrandbits(8) for _ in range(n * SIZES[dt]))
        if dt == "BOOL":
            data = bytes(b & 1 for b in data)
        out[f"model.layers.{i}.t_{dt.lower()}"] = (dt, shape, data)
    return out


def reference_write(tensors, metadata):
    keep, specs = [], {}
    for name, (dt, shape, data) in tensors.items():
        if hasattr(safetensors, "TensorSpec"):
            buf = np.frombuffer(bytearray(data) or bytearray(1), dtype=np.uint8)
            keep.append(buf)
            specs[name] = safetensors.TensorSpec(dtype=PYNAME[dt], shape=shape,
                                                 data_ptr=buf.ctypes.data, data_len=len(data))
        else:
            specs[name] = {"dtype": PYNAME[dt], "shape": shape, "data": data}
    return bytes(safetensors.serialize(specs, metadata=metadata))


def tier_write(lib, path, tensors, metadata):
    arr = (WTensor * len(tensors))()
    bufs = []
    for i, (name, (dt, shape, data)) in enumerate(tensors.items()):
        b = ctypes.create_string_buffer(data, max(len(data), 1))
        bufs.append(b)
        arr[i].name, arr[i].dtype, arr[i].ndim = name.encode(), DTYPES.index(dt), len(shape)
        for d, s in enumerate(shape):
            arr[i].shape[d] = s
        arr[i].data = ctypes.cast(b, ctypes.c_void_p)
    flat = [x.encode() for kv in metadata.items() for x in kv] + [None]
    meta = (ctypes.c_char_p * len(flat))(*flat)
    rc = lib.tier_st_write(path.encode(), arr, len(tensors), meta)
    if rc != 0:
        raise RuntimeError(f"tier_st_write: {rc} {lib.tier_last_error().decode()}")


def tier_read(lib, path):
    st = ctypes.c_void_p()
    rc = lib.tier_st_open(path.encode(), ctypes.byref(st))
    if rc != 0:
        raise RuntimeError(f"tier_st_open: {rc} {lib.tier_last_error().decode()}")
    out = {}
    for i in range(lib.tier_st_count(st)):
        t = lib.tier_st_at(st, i).contents
        buf = ctypes.create_string_buffer(max(t.nbytes, 1))
        assert lib.tier_st_read(st, t.name, buf, t.nbytes) == 0, lib.tier_last_error()
        out[t.name.decode()] = (DTYPES[t.dtype], [t.shape[d] for d in range(t.ndim)], buf.raw[:t.nbytes])
    fmt = lib.tier_st_metadata(st, b"format")
    lib.tier_st_close(st)
    return out, fmt.decode() if fmt else None


def compare(what, want, got):
    bad = 0
    for name, (dt, shape, data) in want.items():
        g = got.get(name)
        if g is None or g[0] != dt or list(g[1]) != list(shape) or g[2] != data:
            print(f"MISMATCH {what}: {name}: want {dt} {shape} {len(data)} B, got "
                  f"{None if g is None else (g[0], g[1], len(g[2]))}")
            bad += 1
    if set(got) != set(want):
        print(f"MISMATCH {what}: names differ: {sorted(set(got) ^ set(want))}")
        bad += 1
    print(f"{what}: {len(want)} tensors, {bad} mismatches")
    return bad


def differential(lib, dirs):
    agree = disagree = limits = 0
    for d in dirs:
        for f in sorted(os.listdir(d)):
            data = open(os.path.join(d, f), "rb").read()
            try:
                safetensors.deserialize(data)
                ref_ok = True
            except Exception:
                ref_ok = False
            st = ctypes.c_void_p()
            rc = lib.tier_st_parse_header(data, len(data), len(data), f.encode(), ctypes.byref(st))
            if rc == 0:
                lib.tier_st_close(st)
            if (rc == 0) == ref_ok:
                agree += 1
            elif ref_ok and rc == -95:     # -ENOTSUP: a documented tier limit (dtype, > 8 dims)
                limits += 1
                print(f"LIMIT {f}: {lib.tier_last_error().decode(errors='replace')}")
            else:
                disagree += 1
                print(f"DISAGREE {f}: reference {'accepts' if ref_ok else 'rejects'}, tier rc {rc} "
                      f"{lib.tier_last_error().decode(errors='replace')}")
    print(f"differential: {agree} agree, {limits} valid files tier declines (-ENOTSUP), {disagree} disagree")
    return disagree


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True, help="path to libtier.so")
    ap.add_argument("--corpus", action="append", default=[], help="directory of files to parse with both")
    ap.add_argument("--seed", type=int, default=random.randrange(1 << 30))
    a = ap.parse_args()
    print(f"# safetensors {safetensors.__version__}, seed {a.seed}")
    lib, rng, bad = load_lib(a.lib), random.Random(a.seed), 0
    with tempfile.TemporaryDirectory() as tmp:
        t1 = random_tensors(rng)
        p1 = os.path.join(tmp, "by_tier.safetensors")
        tier_write(lib, p1, t1, {"format": "pt", "who": "tier"})
        raw = open(p1, "rb").read()
        got = {n: (v["dtype"], v["shape"], bytes(v["data"])) for n, v in safetensors.deserialize(raw)}
        bad += compare("tier -> reference", t1, got)
        with safe_open(p1, framework="numpy") as f:
            if f.metadata() != {"format": "pt", "who": "tier"}:
                print(f"MISMATCH metadata {f.metadata()}")
                bad += 1
        t2 = random_tensors(rng)
        p2 = os.path.join(tmp, "by_reference.safetensors")
        open(p2, "wb").write(reference_write(t2, {"format": "pt"}))
        got, fmt = tier_read(lib, p2)
        bad += compare("reference -> tier", t2, got) + (fmt != "pt")
    if a.corpus:
        bad += differential(lib, a.corpus)
    print("OK" if bad == 0 else f"FAILED ({bad})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
