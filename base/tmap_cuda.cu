/* tmap_cuda.cu - tensor maps for the wgmma kernels' TMA loads (base/tmap_cuda.h). */
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include "tier/base.h"
#include "base/tmap_cuda.h"

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn;
static pthread_once_t tmap_once = PTHREAD_ONCE_INIT;

static void tmap_lookup(void)
{
	void *e = NULL;
	cudaDriverEntryPointQueryResult qe;
	if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &e, 12000, cudaEnableDefault, &qe) == cudaSuccess &&
	    qe == cudaDriverEntryPointSuccess)
		encode_fn = (PFN_cuTensorMapEncodeTiled_v12000)e;
	(void)cudaGetLastError(); /* leave no error behind for a later launch check */
}

static int tmap_ready(const char *fn)
{
	pthread_once(&tmap_once, tmap_lookup);
	if (!encode_fn)
		return tier_fail(-ENOTSUP, "%s: the CUDA driver has no cuTensorMapEncodeTiled (12.0 or later needed); "
				 "the MoE products load without TMA with TIER_MOE_WGMMA_TMA=0, attention with TIER_ATTN_FWD=v2", fn);
	return 0;
}

extern "C" int base_tmap_ok(void)
{
	pthread_once(&tmap_once, tmap_lookup);
	return encode_fn != NULL;
}

/* The map of bf16 rows x cols (rank 2), or of batch such matrices one after the other (rank 3);
 * boxes of box_bytes of a row (the swizzle's width: 128 or 64) x box_rows (x 1). */
static CUresult encode_box(CUtensorMap *m, const void *base, int rank, uint64_t batch, uint64_t rows, uint64_t cols,
			   uint32_t box_rows, int f32, uint32_t box_bytes)
{
	const uint64_t esz = f32 ? 4 : 2;
	cuuint64_t dims[3] = { cols, rows, batch }, strides[2] = { cols * esz, rows * cols * esz };
	cuuint32_t box[3] = { (cuuint32_t)(box_bytes / esz), box_rows, 1 }, step[3] = { 1, 1, 1 };
	return encode_fn(m, f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank,
			 (void *)base, dims, strides, box, step, CU_TENSOR_MAP_INTERLEAVE_NONE,
			 box_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
			 CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

/* The sequence maps of either type: rows of cols elements (16 bytes' worth a multiple), checked,
 * then encoded; the errors name fn. */
static int map_seq(const char *fn, CUtensorMap *m, const void *base, uint64_t batch, uint64_t seq, uint64_t cols,
		   uint32_t box_rows, int f32)
{
	const char *ty = f32 ? "fp32" : "bf16";
	const uint64_t per16 = f32 ? 4 : 8; /* elements in 16 bytes */
	int rc = tmap_ready(fn);
	if (rc)
		return rc;
	if (!m || !base || (uintptr_t)base % 16 || batch < 1 || seq < 1 || cols < per16 || cols % per16 ||
	    batch >> 31 || seq >> 31 || cols >> 32 || box_rows < 1 || box_rows > 256)
		return tier_fail(-EINVAL, "%s: %llu sequences of %llu x %llu %s at %p with %u-row boxes cannot be mapped",
				 fn, (unsigned long long)batch, (unsigned long long)seq, (unsigned long long)cols, ty, base,
				 box_rows);
	CUresult r = encode_box(m, base, 3, batch, seq, cols, box_rows, f32, 128);
	if (r != CUDA_SUCCESS)
		return tier_fail(-EINVAL, "%s: cuTensorMapEncodeTiled refused %llu sequences of %llu x %llu %s (CUresult %d)",
				 fn, (unsigned long long)batch, (unsigned long long)seq, (unsigned long long)cols, ty, (int)r);
	return 0;
}

extern "C" int base_tmap_bf16_seq(CUtensorMap *m, const void *base, uint64_t batch, uint64_t seq, uint64_t cols,
				  uint32_t box_rows)
{
	return map_seq("base_tmap_bf16_seq", m, base, batch, seq, cols, box_rows, 0);
}

extern "C" int base_tmap_f32_seq(CUtensorMap *m, const void *base, uint64_t batch, uint64_t seq, uint64_t cols,
				 uint32_t box_rows)
{
	return map_seq("base_tmap_f32_seq", m, base, batch, seq, cols, box_rows, 1);
}

/* The bf16 matrix maps (rank 2): rows x cols, boxes of box_bytes of a row (128 or 64, the swizzle)
 * x box_rows, checked. */
static int map_bf16(const char *fn, CUtensorMap *m, const void *base, uint64_t rows, uint64_t cols, uint32_t box_rows,
		    uint32_t box_bytes)
{
	int rc = tmap_ready(fn);
	if (rc)
		return rc;
	if (!m || !base || (uintptr_t)base % 16 || rows < 1 || cols < 8 || cols % 8 || rows >> 32 || cols >> 32 ||
	    box_rows < 1 || box_rows > 256)
		return tier_fail(-EINVAL, "%s: a %llu x %llu bf16 matrix at %p with %u-row boxes cannot be mapped", fn,
				 (unsigned long long)rows, (unsigned long long)cols, base, box_rows);
	CUresult r = encode_box(m, base, 2, 1, rows, cols, box_rows, 0, box_bytes);
	if (r != CUDA_SUCCESS)
		return tier_fail(-EINVAL, "%s: cuTensorMapEncodeTiled refused a %llu x %llu matrix (CUresult %d)", fn,
				 (unsigned long long)rows, (unsigned long long)cols, (int)r);
	return 0;
}

extern "C" int base_tmap_bf16(CUtensorMap *m, const void *base, uint64_t rows, uint64_t cols, uint32_t box_rows)
{
	return map_bf16("base_tmap_bf16", m, base, rows, cols, box_rows, 128);
}

extern "C" int base_tmap_bf16_store(CUtensorMap *m, const void *base, uint64_t rows, uint64_t cols)
{
	return map_bf16("base_tmap_bf16_store", m, base, rows, cols, 64, 64);
}
