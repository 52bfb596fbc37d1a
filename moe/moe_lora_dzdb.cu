/* moe_lora_dzdb.cu - the two products of a LoRA adapter's backward that read dY, in one pass over it
 * (moe_skinny.h: moe_cuda_grouped_dzdb): dZ = s dY B_e and dB_e += alpha dY^T Z over each expert's
 * rows.
 *
 * Why: dY (rows x out bf16: dG and dU of the gate and up adapters, the layer's dY of the down one)
 * is the largest operand of both products, and each is bound by reading it. The separate kernels
 * (moe_skinny.cu for dZ, moe_grouped.cu's reduction for dB) read it twice; this one reads it once
 * (session 17's `tier-bench lora` on an H200: dZ g 28.5 us and dB g 35.9 us, each about half of the
 * copy's rate, for one 50 MB read of dG).
 *
 * Work. One CTA per expert walks the expert's rows in 64-row slices and, within a slice, out in
 * 64-column stages; a stage holds dY's 64 x 64 tile, the 64 rows of B_e [out, r] of its columns and
 * the 64 rows of Z [rows, r] of its slice (ranks 8 and 16, padded to 16 columns by zero-fill).
 * Eight warps share each stage's dY tile, in two roles:
 *  - warp w < 4: dZ of the slice's rows 16 w.. over the stage's 64 columns (k), accumulated in
 *    registers over the slice's stages and stored (bf16 of s times the sum, as
 *    moe_cuda_grouped_skinny rounds it) after the slice's last stage;
 *  - warp 4 + w: dB of the stage's columns 16 w.. (its m) over the slice's 64 rows (k), added to
 *    the CTA's dB in shared memory (fp32 [out][16]). Each warp owns its columns of every stage, so
 *    those adds need no barrier.
 * Two roles, not four warps doing both: an SM holds one CTA (the experts about fill the SMs, and the
 * shared dB takes most of the memory), and each warp's products are a chain of dependent mma and
 * ldmatrix latencies; with both products in one warp a stage took ~0.6 us of that chain (the first
 * build: dZ + dB of gate at 0.33 of the copy's rate, session 20 on an H200).
 * At the end the CTA adds alpha times its shared dB to dB_e: the CTA owns its expert's gradient, so
 * there are no atomics and the sums have one order (the same bits from run to run).
 *
 * One CTA an expert is balanced only when the groups are: the caller keeps the separate kernels
 * where one expert holds a large share of the rows (moe_experts_grouped.cu: dzdb_fits). The shared
 * dB limits out (about 2,900 columns with three stages).
 *
 * Pipeline: 16-byte cp.async through the ring of cp_async_ring (base/mma_sm80.cuh), 3 to 8 stages
 * by what shared memory leaves beside the dB; rows past the group and columns past out are zero-
 * filled, so they add nothing. mma.sync m16n8k16 bf16 -> fp32 with ldmatrix fragments (sm_80
 * instructions: the build's sm_90a code and its compute_90 PTX both have them). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "moe/moe_cu.cuh"
#include "moe/moe_skinny.h"
#include "base/mma_sm80.cuh"

#define DZ_BK 64                           /* rows of a slice, columns of a stage */
#define DZ_THREADS 256                     /* 8 warps: 4 for dZ, 4 for dB */
#define DZ_PAD 8                           /* bf16 added to each shared row against ldmatrix bank conflicts */
#define DZ_RP 16                           /* the rank's columns: ranks 8 and 16 */
#define DZ_LDY (DZ_BK + DZ_PAD)            /* dY tile row stride */
#define DZ_LDR (DZ_RP + DZ_PAD)            /* B and Z rows' stride */
#define DZ_STAGE (DZ_BK * (DZ_LDY + 2 * DZ_LDR)) /* bf16 per stage: dY tile, B rows, Z rows */
#define DZ_STAGE_BYTES (DZ_STAGE * 2)

/* __grid_constant__: the two pointer tables (8 KiB each) stay in parameter space. */
struct dzdb_args {
	const bf16 *b[TIER_MOE_MAX_EXPERTS]; /* B_e [out, r] */
	float *db[TIER_MOE_MAX_EXPERTS];     /* dB_e [out, r] fp32; NULL: not wanted */
	const int32_t *off;
	const bf16 *dy, *z;
	bf16 *dz;
	float s, alpha;
	int out, r;
};

/* dZ rows 16 warp.. of the slice += the stage's dY rows times B's rows: A = dY [row][col] (k the
 * columns), B = B_e [col][r] (k-major: transposed fragments). acc[nj]: columns 8 nj... */
__device__ __forceinline__ void dzdb_dz(float (*acc)[4], const bf16 *sy, const bf16 *sb, int warp, int lane)
{
	int l8 = lane & 7, k8 = ((lane >> 3) & 1) * 8, n8 = (lane >> 4) * 8;
#pragma unroll
	for (int kk = 0; kk < DZ_BK; kk += 16) {
		uint32_t a[4], b[4];
		ldsm4(a, sy + (warp * 16 + (lane & 15)) * DZ_LDY + kk + (lane >> 4) * 8);
		ldsm4t(b, sb + (kk + l8 + k8) * DZ_LDR + n8);
		mma16816(acc[0], a, b);
		mma16816(acc[1], a, b + 2);
	}
}

/* dB rows (of out) c0 + 16 warp.. += the stage's dY^T Z: A = dY^T (m the columns, k the slice's
 * rows; from [row][col], transposed), B = Z [row][r] (transposed). The 16 x 16 result is added to
 * the shared dB: the accumulator (nj) holds rows g, g + 8 (g = lane / 4), columns 8 nj + 2 (lane %
 * 4) and the next. */
__device__ __forceinline__ void dzdb_db(float *sdb, const bf16 *sy, const bf16 *sz, int out, int c0, int warp,
					int lane)
{
	float acc[2][4] = {};
#pragma unroll
	for (int kk = 0; kk < DZ_BK; kk += 16) {
		uint32_t a[4], b[4];
		ldsm4t(a, sy + (kk + (lane & 7) + (lane >> 4) * 8) * DZ_LDY + warp * 16 + ((lane >> 3) & 1) * 8);
		ldsm4t(b, sz + (kk + (lane & 7) + ((lane >> 3) & 1) * 8) * DZ_LDR + (lane >> 4) * 8);
		mma16816(acc[0], a, b);
		mma16816(acc[1], a, b + 2);
	}
	int m = c0 + warp * 16 + (lane >> 2), n = 2 * (lane & 3);
#pragma unroll
	for (int h = 0; h < 2; h++) {
		if (m + 8 * h >= out) /* zero-filled columns past out */
			continue;
#pragma unroll
		for (int nj = 0; nj < 2; nj++) {
			float2 *p = (float2 *)(sdb + (m + 8 * h) * DZ_RP + nj * 8 + n);
			float2 v = *p;
			v.x += acc[nj][2 * h], v.y += acc[nj][2 * h + 1];
			*p = v;
		}
	}
}

/* The slice's dZ rows 16 warp.., bf16(s acc), those before rend and columns before r. */
__device__ __forceinline__ void dzdb_store_dz(const float (*acc)[4], const dzdb_args &a, int r0, int rend, int warp,
					      int lane)
{
#pragma unroll
	for (int h = 0; h < 2; h++) {
		int row = r0 + warp * 16 + (lane >> 2) + 8 * h;
		if (row >= rend)
			continue;
#pragma unroll
		for (int nj = 0; nj < 2; nj++) {
			int col = nj * 8 + 2 * (lane & 3); /* even, r % 8 == 0: col + 1 < r too */
			if (col < a.r)
				*(__nv_bfloat162 *)(a.dz + (size_t)row * a.r + col) =
					__floats2bfloat162_rn(a.s * acc[nj][2 * h], a.s * acc[nj][2 * h + 1]);
		}
	}
}

/* Rows [row0, row0 + 64) of a bf16 [*, r] matrix into s [64][DZ_LDR] (rows before rend, columns
 * before r; zeros elsewhere) by 128 threads (q = 0..127): one 16-byte chunk each, two a row. */
__device__ __forceinline__ void dzdb_load_rows(bf16 *s, const bf16 *g, int r, int row0, int rend, int q)
{
	int row = q >> 1, c = (q & 1) * 8, gr = row0 + row;
	bool ok = gr < rend && c < r; /* r % 8 == 0: a chunk is all in or all out */
	cp_async16(s + row * DZ_LDR + c, ok ? g + (size_t)gr * r + c : g, ok);
}

/* dB_e += alpha times the shared sums; C rows of r floats (r % 4 == 0, C 16-byte aligned). */
__device__ __forceinline__ void dzdb_store_db(const float *sdb, const dzdb_args &a, float *C)
{
	int q = a.r / 4;
	for (int i = threadIdx.x; i < a.out * q; i += DZ_THREADS) {
		int m = i / q, n = i % q * 4;
		float4 s = *(const float4 *)(sdb + m * DZ_RP + n), *p = (float4 *)(C + (size_t)m * a.r + n), c = *p;
		c.x += a.alpha * s.x, c.y += a.alpha * s.y, c.z += a.alpha * s.z, c.w += a.alpha * s.w;
		*p = c;
	}
}

template <int STAGES>
__global__ void __launch_bounds__(DZ_THREADS) dzdb_kernel(const __grid_constant__ dzdb_args a)
{
	extern __shared__ __align__(16) unsigned char dz_smem[];
	int e = blockIdx.x, row0 = a.off[e], rend = a.off[e + 1];
	if (rend <= row0)
		return; /* no rows: dB_e stays as it is */
	float *C = a.db[e], *sdb = (float *)dz_smem;
	const bf16 *B = a.b[e];
	bf16 *ring = (bf16 *)(dz_smem + (size_t)a.out * DZ_RP * sizeof(float));
	int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, ncol = (a.out + DZ_BK - 1) / DZ_BK;
	int nk = ncol * ((rend - row0 + DZ_BK - 1) / DZ_BK);
	if (C) /* visible to every warp after the ring's first barrier */
		for (int i = threadIdx.x; i < a.out * DZ_RP; i += DZ_THREADS)
			sdb[i] = 0.0f;
	float dz[2][4] = {};
	auto load = [&](int kt) {
		bf16 *s = ring + kt % STAGES * DZ_STAGE;
		int r0 = row0 + kt / ncol * DZ_BK, c0 = kt % ncol * DZ_BK;
		cp_async_tile<DZ_BK, DZ_BK, DZ_LDY, DZ_THREADS>(s, a.dy, a.out, r0, rend, c0, a.out);
		if (threadIdx.x < 128) /* B's rows of the stage's columns; Z's of its slice */
			dzdb_load_rows(s + DZ_BK * DZ_LDY, B, a.r, c0, a.out, threadIdx.x);
		else if (C)
			dzdb_load_rows(s + DZ_BK * (DZ_LDY + DZ_LDR), a.z, a.r, r0, rend, threadIdx.x - 128);
	};
	cp_async_ring<STAGES>(nk, load, [&](int slot, int kt) {
		const bf16 *sy = ring + slot * DZ_STAGE, *sb = sy + DZ_BK * DZ_LDY, *sz = sb + DZ_BK * DZ_LDR;
		int ct = kt % ncol;
		if (warp >= 4) {
			if (C)
				dzdb_db(sdb, sy, sz, a.out, ct * DZ_BK, warp - 4, lane);
			return;
		}
		dzdb_dz(dz, sy, sb, warp, lane);
		if (ct == ncol - 1) { /* the slice's last stage: its dZ is whole */
			dzdb_store_dz(dz, a, row0 + kt / ncol * DZ_BK, rend, warp, lane);
#pragma unroll
			for (int nj = 0; nj < 2; nj++)
#pragma unroll
				for (int i = 0; i < 4; i++)
					dz[nj][i] = 0.0f;
		}
	});
	cp_async_wait<0>(); /* only empty groups remain; leave none behind */
	if (!C)
		return;
	__syncthreads(); /* every warp's adds to the shared dB are done */
	dzdb_store_db(sdb, a, C);
}

/* ---- host side ---- */
static size_t dzdb_bytes(int out, int stages) { return (size_t)out * DZ_RP * sizeof(float) + (size_t)stages * DZ_STAGE_BYTES; }

template <int STAGES>
static int dzdb_launch(tier_dev *dev, const dzdb_args &a, int E)
{
	size_t bytes = dzdb_bytes(a.out, STAGES);
	CUDA_TRY(cudaFuncSetAttribute(dzdb_kernel<STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
	dzdb_kernel<STAGES><<<(unsigned)E, DZ_THREADS, bytes, moe_stream(dev)>>>(a);
	CUDA_LAUNCHED();
	return 0;
}

/* The stages: as many as fit beside the dB (at most 8, which keep ~100 KB of dY in flight on an SM)
 * with one CTA an SM when the experts fit the SMs, else with two (4 stages of gate's shape), so that
 * an SM streams one expert while it starts the next; at least 3. 0 when not even 3 fit. */
static int dzdb_stages(int out, int E, int per_block, int per_sm, int sms)
{
	static const int st[] = { 8, 6, 4, 3 };
	for (int want = E > sms ? 2 : 1; want >= 1; want--)
		for (size_t i = 0; i < sizeof st / sizeof st[0]; i++) {
			size_t b = dzdb_bytes(out, st[i]);
			if (b <= (size_t)per_block && (size_t)want * (b + 1024) <= (size_t)per_sm)
				return st[i];
		}
	return 0;
}

static int dzdb_limits(tier_dev *dev, int *per_block, int *per_sm, int *sms)
{
	int ord = tier_dev_ordinal(dev);
	CUDA_TRY(cudaDeviceGetAttribute(per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, ord));
	CUDA_TRY(cudaDeviceGetAttribute(per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, ord));
	CUDA_TRY(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, ord));
	return 0;
}

extern "C" int moe_cuda_dzdb_max_out(tier_dev *dev)
{
	int per_block, per_sm, sms;
	if (moe_cuda_dev(dev, "moe_cuda_dzdb_max_out") || dzdb_limits(dev, &per_block, &per_sm, &sms))
		return 0;
	long long out = ((long long)per_block - 3LL * DZ_STAGE_BYTES) / (DZ_RP * (long long)sizeof(float));
	return out < 8 ? 0 : (int)(out / 8 * 8);
}

/* The scalar arguments and the buffers; the tables are checked by the caller below. */
static int dzdb_check(const char *fn, tier_dev *dev, int E, int out, int r, int rows_bound, float s, float alpha)
{
	int rc = moe_cuda_dev(dev, fn);
	if (rc || (rc = moe_check_tk(fn, 1, 1, E)) || (rc = moe_check_dim(fn, "out", out)))
		return rc;
	if (r != 8 && r != 16)
		return tier_fail(-EINVAL, "%s: rank r = %d; it must be 8 or 16; use moe_cuda_grouped_skinny and "
				 "moe_cuda_grouped_wgrad for other ranks", fn, r);
	if (out % 8)
		return tier_fail(-EINVAL, "%s: out = %d is not a multiple of 8 (16-byte copies); use the separate "
				 "products for other shapes", fn, out);
	if (rows_bound < 0)
		return tier_fail(-EINVAL, "%s: rows_bound %d < 0; pass an upper bound on offsets[E]", fn, rows_bound);
	if (!isfinite(s) || !isfinite(alpha))
		return tier_fail(-EINVAL, "%s: s = %g, alpha = %g; pass finite scales", fn, (double)s, (double)alpha);
	return 0;
}

extern "C" int moe_cuda_grouped_dzdb(tier_dev *dev, int E, int out, int r, const int32_t *d_off, int rows_bound,
				     const void *const *b, const void *dy, const void *z, float s, float alpha, void *dz,
				     float *const *db)
{
	const char *fn = "moe_cuda_grouped_dzdb";
	int per_block, per_sm, sms, rc = dzdb_check(fn, dev, E, out, r, rows_bound, s, alpha);
	if (rc || (rc = moe_check_buf16(fn, "dy", dy)) || (rc = moe_check_buf16(fn, "dz", dz)) ||
	    (rc = moe_check_table16(fn, "b", E, b)))
		return rc;
	MOE_NONNULL(d_off, fn);
	MOE_NONNULL(db, fn);
	dzdb_args a; /* 16 KiB */
	int wanted = 0;
	for (int e = 0; e < TIER_MOE_MAX_EXPERTS; e++) {
		a.b[e] = e < E ? (const bf16 *)b[e] : NULL;
		a.db[e] = e < E && alpha != 0.0f ? db[e] : NULL;
		if ((uintptr_t)a.db[e] % 16)
			return tier_fail(-EINVAL, "%s: db[%d] is not 16-byte aligned; pass aligned gradients", fn, e);
		wanted += a.db[e] != NULL;
	}
	if (wanted && (rc = moe_check_buf16(fn, "z", z)))
		return rc;
	if ((rc = dzdb_limits(dev, &per_block, &per_sm, &sms)))
		return rc;
	int stages = dzdb_stages(out, E, per_block, per_sm, sms);
	if (!stages)
		return tier_fail(-EINVAL, "%s: out = %d leaves no room for the shared dB (%d bytes a block); use the "
				 "separate products (moe_cuda_dzdb_max_out says the largest out)", fn, out, per_block);
	if (rows_bound == 0)
		return 0; /* no rows: nothing to write */
	a.off = d_off, a.dy = (const bf16 *)dy, a.z = (const bf16 *)z, a.dz = (bf16 *)dz;
	a.s = s, a.alpha = alpha, a.out = out, a.r = r;
	switch (stages) {
	case 8: return dzdb_launch<8>(dev, a, E);
	case 6: return dzdb_launch<6>(dev, a, E);
	case 4: return dzdb_launch<4>(dev, a, E);
	default: return dzdb_launch<3>(dev, a, E);
	}
}
