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

#define DZ_MAX_CHUNKS 1536 /* CTAs a launch: the chunk list rides in the parameters (12 KiB) */

/* __grid_constant__: the two pointer tables (8 KiB each) and the chunk list stay in parameter space
 * (28 KiB of the 32 KiB a launch may pass). CTA i takes chunk ck[i]: chunk j of nck of expert e,
 * packed e | j << 10 | nck << 21 (E <= 1024, nck <= 2047), and its experts' first partial slot
 * (multi-chunk experts only). */
struct dzdb_args {
	const bf16 *b[TIER_MOE_MAX_EXPERTS]; /* B_e [out, r] */
	float *db[TIER_MOE_MAX_EXPERTS];     /* dB_e [out, r] fp32; NULL: not wanted */
	uint2 ck[DZ_MAX_CHUNKS];             /* x: e, j, nck; y: the expert's first slot in part */
	const int32_t *off;
	const bf16 *dy, *z;
	bf16 *dz;
	float *part; /* [slots][out][r] fp32: the chunks' partial dB of the experts split in chunks */
	int *cnt;    /* [E]: the chunks of expert e done (zeroed before the launch) */
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

/* A chunk of an expert split in nck: its partial dB into slot0 + j; the expert's last chunk to get
 * here (a counter) adds alpha times the partials' sum, taken in chunk order, to C: the same bits
 * whichever chunk is last. The threadfence-reduction pattern: each partial is made visible before
 * its count, and the last chunk reads them past its own L1 (__ldcg). */
__device__ __forceinline__ void dzdb_finish(const float *sdb, const dzdb_args &a, float *C, int e, int j, int nck,
					    int slot0)
{
	__shared__ int last;
	size_t each = (size_t)a.out * a.r;
	int q = a.r / 4;
	float *mine = a.part + (slot0 + j) * each;
	for (int i = threadIdx.x; i < a.out * q; i += DZ_THREADS) {
		int m = i / q, n = i % q * 4;
		*(float4 *)(mine + (size_t)m * a.r + n) = *(const float4 *)(sdb + m * DZ_RP + n);
	}
	__threadfence();
	__syncthreads();
	if (threadIdx.x == 0)
		last = atomicAdd(a.cnt + e, 1) == nck - 1;
	__syncthreads();
	if (!last)
		return;
	__threadfence();
	const float *p0 = a.part + slot0 * each;
	for (int i = threadIdx.x; i < a.out * q; i += DZ_THREADS) {
		size_t at = (size_t)(i / q) * a.r + i % q * 4;
		float4 t = __ldcg((const float4 *)(p0 + at)), *p = (float4 *)(C + at), c = *p;
		for (int k = 1; k < nck; k++) {
			float4 v = __ldcg((const float4 *)(p0 + k * each + at));
			t.x += v.x, t.y += v.y, t.z += v.z, t.w += v.w;
		}
		c.x += a.alpha * t.x, c.y += a.alpha * t.y, c.z += a.alpha * t.z, c.w += a.alpha * t.w;
		*p = c;
	}
}

/* Chunk j of nck of a group [lo, hi): 64-row multiples of ceil(n / nck), the last shorter; its first
 * row and end. */
__device__ __forceinline__ int2 dzdb_chunk(int lo, int hi, int j, int nck)
{
	int cs = ((hi - lo + nck - 1) / nck + DZ_BK - 1) / DZ_BK * DZ_BK, row0 = min(hi, lo + j * cs);
	return make_int2(row0, min(hi, row0 + cs));
}

template <int STAGES>
__global__ void __launch_bounds__(DZ_THREADS) dzdb_kernel(const __grid_constant__ dzdb_args a)
{
	extern __shared__ __align__(16) unsigned char dz_smem[];
	uint2 ck = a.ck[blockIdx.x];
	int e = ck.x & 1023, j = (ck.x >> 10) & 2047, nck = ck.x >> 21;
	int2 rows = dzdb_chunk(a.off[e], a.off[e + 1], j, nck);
	int row0 = rows.x, rend = rows.y;
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
	if (nck == 1)
		dzdb_store_db(sdb, a, C);
	else
		dzdb_finish(sdb, a, C, e, j, nck, (int)ck.y);
}

/* ---- host side ---- */
static size_t dzdb_bytes(int out, int stages) { return (size_t)out * DZ_RP * sizeof(float) + (size_t)stages * DZ_STAGE_BYTES; }

template <int STAGES>
static int dzdb_launch(tier_dev *dev, const dzdb_args &a, int n)
{
	size_t bytes = dzdb_bytes(a.out, STAGES);
	CUDA_TRY(cudaFuncSetAttribute(dzdb_kernel<STAGES>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
	dzdb_kernel<STAGES><<<(unsigned)n, DZ_THREADS, bytes, moe_stream(dev)>>>(a);
	CUDA_LAUNCHED();
	return 0;
}

/* The stages: as many as fit beside the dB (at most 8, which keep ~100 KB of dY in flight on an SM)
 * with one CTA an SM when the chunks fit the SMs, else with two (4 stages of gate's shape), so that
 * an SM streams one chunk while it starts the next; at least 3. 0 when not even 3 fit. */
static int dzdb_stages(int out, int n, int per_block, int per_sm, int sms)
{
	static const int st[] = { 8, 6, 4, 3 };
	for (int want = n > sms ? 2 : 1; want >= 1; want--)
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

/* ---- the chunks: one CTA each ---- */
#define DZ_CNT_BYTES (TIER_MOE_MAX_EXPERTS * 4) /* the counters at the scratch's start */

static int dzdb_cs(int n, int nck) { return ((n + nck - 1) / nck + DZ_BK - 1) / DZ_BK * DZ_BK; }

/* How many chunks a group of n rows takes for chunks of about R rows: floor(n / R) (a group under
 * 2R stays whole), fewer where the 64-row rounding would leave the last ones empty. */
static int dzdb_nck(int n, long long R)
{
	long long k = n / R;
	int nck = k < 1 ? 1 : k > 2047 ? 2047 : (int)k;
	while (nck > 1 && (long long)(nck - 1) * dzdb_cs(n, nck) >= n)
		nck--;
	return nck;
}

/* Chunks per expert (nck[e]; 0 without rows) for chunks of about R rows, the split experts' partial
 * slots within `slots` (an expert with no room left stays whole); their total, the slots in *used. */
static int dzdb_split(const int32_t *off, int E, long long R, size_t slots, int *nck, int *used)
{
	int n = 0;
	*used = 0;
	for (int e = 0; e < E; e++) {
		int rows_e = off[e + 1] - off[e], k = slots ? dzdb_nck(rows_e, R) : 1;
		if (k > 1 && (size_t)*used + (size_t)k > slots)
			k = 1;
		nck[e] = rows_e > 0 ? k : 0;
		n += nck[e];
		*used += nck[e] > 1 ? nck[e] : 0;
	}
	return n;
}

/* The chunk list: every expert with rows in chunks of about R rows, R the rows an SM would take if
 * they were spread evenly (at least 64), doubled until the list fits DZ_MAX_CHUNKS (every expert
 * whole always does: E <= 1024). Returns the chunks; the split experts' slots in *nslots. */
static int dzdb_plan(const int32_t *off, int E, int sms, size_t slots, uint2 *ck, int *nslots)
{
	static_assert(TIER_MOE_MAX_EXPERTS <= DZ_MAX_CHUNKS && TIER_MOE_MAX_EXPERTS <= 1024, "the packing");
	int nck[TIER_MOE_MAX_EXPERTS], n = 0, used = 0;
	long long R = ((long long)off[E] + sms - 1) / sms;
	R = R < DZ_BK ? DZ_BK : (R + DZ_BK - 1) / DZ_BK * DZ_BK;
	while (dzdb_split(off, E, R, slots, nck, nslots) > DZ_MAX_CHUNKS)
		R *= 2;
	for (int e = 0; e < E; e++) {
		for (int j = 0; j < nck[e]; j++)
			ck[n++] = make_uint2((unsigned)e | (unsigned)j << 10 | (unsigned)nck[e] << 21, (unsigned)used);
		used += nck[e] > 1 ? nck[e] : 0;
	}
	return n;
}

/* The scalar arguments and the host offsets. */
static int dzdb_check(const char *fn, tier_dev *dev, int E, int out, int r, const int32_t *off, float s, float alpha)
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
	if (!isfinite(s) || !isfinite(alpha))
		return tier_fail(-EINVAL, "%s: s = %g, alpha = %g; pass finite scales", fn, (double)s, (double)alpha);
	MOE_NONNULL(off, fn);
	if (off[0] != 0)
		return tier_fail(-EINVAL, "%s: off[0] = %d; the host offsets start at 0", fn, off[0]);
	for (int e = 0; e < E; e++)
		if (off[e + 1] < off[e])
			return tier_fail(-EINVAL, "%s: off[%d] = %d < off[%d] = %d; pass the routing's nondecreasing offsets",
					 fn, e + 1, off[e + 1], e, off[e]);
	return 0;
}

/* The pointer tables; *wanted: the experts whose dB is wanted. */
static int dzdb_tables(const char *fn, int E, const void *const *b, float *const *db, float alpha, dzdb_args *a,
		       int *wanted)
{
	int rc = moe_check_table16(fn, "b", E, b);
	if (rc)
		return rc;
	MOE_NONNULL(db, fn);
	*wanted = 0;
	for (int e = 0; e < TIER_MOE_MAX_EXPERTS; e++) {
		a->b[e] = e < E ? (const bf16 *)b[e] : NULL;
		a->db[e] = e < E && alpha != 0.0f ? db[e] : NULL;
		if ((uintptr_t)a->db[e] % 16)
			return tier_fail(-EINVAL, "%s: db[%d] is not 16-byte aligned; pass aligned gradients", fn, e);
		*wanted += a->db[e] != NULL;
	}
	return 0;
}

extern "C" int moe_cuda_grouped_dzdb(tier_dev *dev, int E, int out, int r, const int32_t *off, const int32_t *d_off,
				     const void *const *b, const void *dy, const void *z, float s, float alpha, void *dz,
				     float *const *db, void *scratch, size_t scratch_bytes)
{
	const char *fn = "moe_cuda_grouped_dzdb";
	int per_block, per_sm, sms, wanted, rc = dzdb_check(fn, dev, E, out, r, off, s, alpha);
	dzdb_args a; /* 28 KiB, copied into the launch's parameters */
	if (rc || (rc = moe_check_buf16(fn, "dy", dy)) || (rc = moe_check_buf16(fn, "dz", dz)) ||
	    (rc = dzdb_tables(fn, E, b, db, alpha, &a, &wanted)))
		return rc;
	MOE_NONNULL(d_off, fn);
	if (wanted && (rc = moe_check_buf16(fn, "z", z)))
		return rc;
	if (scratch && (uintptr_t)scratch % 16)
		return tier_fail(-EINVAL, "%s: scratch is not 16-byte aligned; pass an aligned buffer", fn);
	if ((rc = dzdb_limits(dev, &per_block, &per_sm, &sms)))
		return rc;
	if (!dzdb_stages(out, 1, per_block, per_sm, sms))
		return tier_fail(-EINVAL, "%s: out = %d leaves no room for the shared dB (%d bytes a block); use the "
				 "separate products (moe_cuda_dzdb_max_out says the largest out)", fn, out, per_block);
	if (off[E] == 0)
		return 0; /* no rows: nothing to write */
	/* split experts' partial dB slots: any number without a dB to sum, else what the scratch holds */
	size_t each = (size_t)out * r * sizeof(float), slots = !wanted ? (size_t)-1
		: scratch && scratch_bytes > DZ_CNT_BYTES ? (scratch_bytes - DZ_CNT_BYTES) / each : 0;
	int nslots, n = dzdb_plan(off, E, sms, slots, a.ck, &nslots);
	a.off = d_off, a.dy = (const bf16 *)dy, a.z = (const bf16 *)z, a.dz = (bf16 *)dz;
	a.cnt = (int *)scratch, a.part = scratch ? (float *)((char *)scratch + DZ_CNT_BYTES) : NULL;
	a.s = s, a.alpha = alpha, a.out = out, a.r = r;
	if (wanted && nslots)
		CUDA_TRY(cudaMemsetAsync(scratch, 0, sizeof(int) * (size_t)E, moe_stream(dev)));
	switch (dzdb_stages(out, n, per_block, per_sm, sms)) {
	case 8: return dzdb_launch<8>(dev, a, n);
	case 6: return dzdb_launch<6>(dev, a, n);
	case 4: return dzdb_launch<4>(dev, a, n);
	default: return dzdb_launch<3>(dev, a, n);
	}
}

extern "C" size_t moe_cuda_dzdb_scratch_bytes(int E, int out, int r, int rows)
{
	(void)E; /* the counters' room is fixed */
	size_t chunks = (size_t)(rows > 0 ? rows : 0) / DZ_BK + TIER_MOE_MAX_EXPERTS;
	chunks = chunks < DZ_MAX_CHUNKS ? chunks : DZ_MAX_CHUNKS;
	return DZ_CNT_BYTES + chunks * (size_t)(out > 0 ? out : 0) * (size_t)(r > 0 ? r : 0) * sizeof(float);
}
