/* mma_sm80.cuh - the warp-level tensor-core primitives of the mma.sync kernels (attn/attn_cuda.cu,
 * moe/moe_grouped.cu), one copy: bf16 m16n8k16 with fp32 accumulation, ldmatrix from shared memory
 * (plain and transposed), and 16-byte cp.async with zero-fill (one chunk, a tile, the ring). PTX ISA sm_80 forms; they run on
 * sm_90 too. Include from .cu files only. */
#ifndef TIER_BASE_MMA_SM80_CUH
#define TIER_BASE_MMA_SM80_CUH

#include <cuda_bf16.h>
#include <stdint.h>

/* c (16 x 8, fp32) += a (16 x 16, row) b (16 x 8, col), the register layouts of mma.m16n8k16. */
__device__ __forceinline__ void mma16816(float c[4], const uint32_t a[4], const uint32_t b[2])
{
	asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
		     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
		     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
		     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

/* Two floats rounded to a bf16 pair in one register (lo in the low half): an A operand piece. */
__device__ __forceinline__ uint32_t pack(float lo, float hi)
{
	__nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
	return *reinterpret_cast<uint32_t *>(&v);
}

/* The A operand of a 16-k step from the fp32 accumulators of two adjacent m16n8 tiles (k 0-7 in
 * c0, 8-15 in c1), rounded to bf16: a product's result fed on as the next one's A (attention's P). */
__device__ __forceinline__ void pack_a(uint32_t (&pa)[4], const float (&c0)[4], const float (&c1)[4])
{
	pa[0] = pack(c0[0], c0[1]), pa[1] = pack(c0[2], c0[3]);
	pa[2] = pack(c1[0], c1[1]), pa[3] = pack(c1[2], c1[3]);
}

__device__ __forceinline__ uint32_t smem_addr(const void *p)
{
	return (uint32_t)__cvta_generic_to_shared(p);
}

/* Four 8x8 bf16 matrices from shared memory; lane i gives the address of row i % 8 of matrix i / 8.
 * With .trans (ldsm4t) each matrix arrives transposed. */
__device__ __forceinline__ void ldsm4(uint32_t r[4], const __nv_bfloat16 *p)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm4t(uint32_t r[4], const __nv_bfloat16 *p)
{
	asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
		     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

/* 16 bytes global -> shared without passing through registers; with !valid nothing is read (gm need
 * only be a valid address) and the 16 bytes are zero. */
__device__ __forceinline__ void cp_async16(void *sm, const void *gm, bool valid)
{
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(sm)), "l"(gm),
		     "r"(valid ? 16 : 0));
}

/* Rows [row0, row0 + ROWS) x columns [col0, col0 + COLS) of the bf16 matrix g (row stride ld) into
 * shared s (row stride LD), in 16-byte chunks over THREADS threads; rows at or past rend and
 * columns at or past cend (a multiple of 8 from col0: a chunk is all in or all out) load zeros. */
template <int ROWS, int COLS, int LD, int THREADS>
__device__ __forceinline__ void cp_async_tile(__nv_bfloat16 *s, const __nv_bfloat16 *g, size_t ld, int row0, int rend,
					      int col0, int cend)
{
	constexpr int CPR = COLS / 8; /* chunks per row */
	static_assert(ROWS * CPR % THREADS == 0, "whole chunks per thread");
#pragma unroll
	for (int i = 0; i < ROWS * CPR / THREADS; i++) {
		int q = threadIdx.x + i * THREADS, r = q / CPR, c = q % CPR * 8, gr = row0 + r, gc = col0 + c;
		bool ok = gr < rend && gc < cend;
		cp_async16(s + r * LD + c, ok ? g + (size_t)gr * ld + gc : g, ok);
	}
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

/* Wait until at most N committed groups are still in flight. */
template <int N>
__device__ __forceinline__ void cp_async_wait()
{
	asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* The multi-stage cp.async ring over nk k-steps: STAGES - 1 loads in flight ahead of the step being
 * computed. load(kt) issues the copies of step kt into slot kt % STAGES; compute(slot, kt) reads
 * the slot once its copies have landed. One commit per step (empty past the last load) keeps the
 * wait count fixed; the barrier after the wait also guarantees that every warp is done with the
 * slot the next load overwrites. */
template <int STAGES, typename Load, typename Compute>
__device__ __forceinline__ void cp_async_ring(int nk, Load load, Compute compute)
{
#pragma unroll
	for (int kt = 0; kt < STAGES - 1; kt++) {
		if (kt < nk)
			load(kt);
		cp_async_commit();
	}
	for (int kt = 0; kt < nk; kt++) {
		cp_async_wait<STAGES - 2>();
		__syncthreads();
		if (kt + STAGES - 1 < nk)
			load(kt + STAGES - 1);
		cp_async_commit();
		compute(kt % STAGES, kt);
	}
}

#endif
