/* tmap_cuda.h - tensor maps for TMA loads (Hopper's tensor memory accelerator) of bf16 row-major
 * matrices, in the 128-byte swizzle the wgmma kernels read (moe_wgmma.cu): a box is 64 columns (128
 * bytes, one swizzle row) by box_rows rows, and reads past the matrix's edges fill zeros.
 *
 * The encoder lives in the driver (cuTensorMapEncodeTiled); it is looked up once through the
 * runtime's cudaGetDriverEntryPointByVersion, so libtier does not link libcuda itself. Host only. */
#ifndef TIER_BASE_TMAP_CUDA_H
#define TIER_BASE_TMAP_CUDA_H

#include <cuda.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when the driver has the encoder (then base_tmap_bf16 fails only for bad arguments), else 0. */
int base_tmap_ok(void);

/* m describes base as bf16 [rows, cols] (row stride cols; base 16-byte aligned, cols a multiple of
 * 8, 1 <= rows, cols < 2^32), boxes of 64 columns by box_rows (1..256). 0, or -EINVAL / -ENOTSUP
 * with the reason in tier_last_error(). */
int base_tmap_bf16(CUtensorMap *m, const void *base, uint64_t rows, uint64_t cols, uint32_t box_rows);
/* The same matrix as batch sequences of seq rows (a 3-D map: columns, row in the sequence,
 * sequence; boxes 64 x box_rows x 1), so that a box past a sequence's end reads zeros, not the next
 * sequence's rows (tma_load3 in base/sm90.cuh; batch, seq < 2^31). */
int base_tmap_bf16_seq(CUtensorMap *m, const void *base, uint64_t batch, uint64_t seq, uint64_t cols,
		       uint32_t box_rows);

/* m describes base as bf16 [rows, cols] for TMA stores of 64-row x 32-column boxes (64 bytes of a
 * row) in the 64B swizzle (tma_store in base/sm90.cuh); the same limits as base_tmap_bf16. */
int base_tmap_bf16_store(CUtensorMap *m, const void *base, uint64_t rows, uint64_t cols);

/* The same for fp32 (tma_reduce_add3's target): batch sequences of seq rows of cols floats (cols a
 * multiple of 4), boxes of 32 columns (128 bytes) x box_rows x 1 in the 128B swizzle. */
int base_tmap_f32_seq(CUtensorMap *m, const void *base, uint64_t batch, uint64_t seq, uint64_t cols,
		      uint32_t box_rows);

#ifdef __cplusplus
}
#endif
#endif
