/* moe_wgmma_cfg.cuh - the wgmma grouped GEMMs' (moe_wgmma.cu) constants, kernel parameters, tile
 * configurations and shared-memory carving; included by moe_wgmma.cu and its other pieces only. */
#ifndef TIER_MOE_WGMMA_CFG_CUH
#define TIER_MOE_WGMMA_CFG_CUH

#include <stdint.h>
#include "moe/moe_cu.cuh"
#include "base/tmap_cuda.h"
#include "moe/moe_wgmma.h"

#define WG_BK 64             /* k per stage: 64 bf16, one 128-byte swizzle row */
#define WG_ROW 128           /* bytes per shared row of either operand */
#define WG_IDLE_DYN 2        /* args::idle unset: idle consumers only where the tiles are claimed in turn */
#define WG_SCHED_AUTO 2      /* TIER_MOE_WGMMA_SCHED unset: dynamic for small groups (wg_plan) */
#define WG_THREADS 384       /* warpgroup 0 loads, warpgroups 1 and 2 multiply */
#define WG_PRODUCERS 128     /* warpgroup 0: each arrives on a stage's full barrier */
#define WG_SMEM (227 * 1024) /* Hopper's shared memory per block */
#define WG_OUT_ROW 144        /* bytes per row of a consumer's output staging: 128 and 16 of padding */
#define WG_OUT_BYTES (64 * WG_OUT_ROW) /* a consumer's staging: 64 rows of 128 bytes */
#define WG_ST_BYTES (64 * 64)          /* one of a consumer's two TMA-store stagings: 64 rows x 32 bf16 */
#define WG_SCHED 8 /* slots of the ring of claimed tiles (TIER_MOE_WGMMA_SCHED=dynamic, wg_seq) */

/* What B is and what the epilogue writes. */
enum {
	WG_NK, /* W_e [N, K] (K-major B): C = alpha X W_e^T + beta C */
	WG_KN, /* W_e [K, N] (MN-major B): C = alpha X W_e + beta C */
	WG_GU  /* gate_e and up_e [I, K], 8 rows of each in turn: g, u and h = silu(g) u */
};
#define WG_MN_BLOCK (WG_BK * WG_ROW) /* bytes of a 64-column block of an MN-major B stage */

/* TIER_MOE_WGMMA_DEBUG: kernels that leave one part out, to see which part bounds the time (their
 * outputs are wrong). */
enum { WG_DBG_NONE, WG_DBG_NOSTORE, WG_DBG_NOMMA, WG_DBG_NOLOAD, WG_NDBG };

/* An extra K segment (moe_wg_seg) as the kernel reads it: the weight tables are device arrays (the
 * parameter space has no room for more 8 KiB tables). */
#define WG_SEGS MOE_WG_SEGS
static_assert(MOE_WG_TAB_BYTES <= MOE_LORA_TAB_BYTES, "the experts' z scratch holds the tables");
struct wg_seg_dev {
	const bf16 *x0, *x1;
	const bf16 *const *w0, *const *w1;
	int K0, K1;
};

/* The kernel's parameters (__grid_constant__: the 8 KiB pointer tables stay in parameter space). */
template <int MODE>
struct wg_args {
	/* TMA loads (wg_cfg::TMA): x as [rows_bound, K] in BM-row boxes, and in device memory the maps
	 * of each expert's B: W_e [N, K] (BN-row boxes), gate_e then up_e (BN / 2 rows each) or W_e
	 * [K, N] (64 x 64 boxes); then those of the extra segments that TMA loads (smap[q] >= 0: their
	 * first map, one an expert), whose x0 or x1 map is xmap[q] */
	CUtensorMap amap;
	CUtensorMap xmap[WG_SEGS];
	const CUtensorMap *bmap;
	int smap[WG_SEGS];
	const bf16 *w[TIER_MOE_MAX_EXPERTS]; /* W_e; gate/up: gate_e */
	const int32_t *off;
	const bf16 *x;
	void *c; /* C; gate/up: g, bf16 */
	float alpha;
	int E, N, K, beta; /* N: the output columns (gate/up: I) */
	int rt_bound;      /* row tiles at or past it are never computed: rows_bound's bound on them */
	int idle;          /* consumers whose rows all lie past their group's end skip the products (wg_mainloop);
			    * on the host also WG_IDLE_DYN, resolved at launch */
	/* the launch's tile counter (device memory after B's maps, zeroed by the map kernel): the CTAs
	 * claim tiles from it in turn (wg_seq; TIER_MOE_WGMMA_SCHED=dynamic). NULL: CTA b takes tiles
	 * b, b + grid, ... */
	unsigned int *sched;
	int dyn; /* the host's wish for sched, where the kernel takes it (wg_cfg::DYN) */
	bf16 *u;           /* gate/up: u, bf16 */
	bf16 *h;           /* gate/up: h, bf16 */
	const bf16 *up[MODE == WG_GU ? TIER_MOE_MAX_EXPERTS : 1]; /* gate/up: up_e */
	int nseg;                /* extra K segments after the main one (0..WG_SEGS) */
	wg_seg_dev seg[WG_SEGS]; /* their operands, with device tables of weights */
	/* OUT wg_swb (the SwiGLU backward in the epilogue): g and u bf16 [rows, N] read, dg and du
	 * written, and each row's dot of dh and silu(g) u by 128-column slots, dot[r parts + slot] */
	const bf16 *sg, *su;
	bf16 *sdg, *sdu;
	float *sdot;
	int parts;
	/* the TMA stores' maps (wg_cfg::ST): the bf16 C, or gate/up's g, u and h (base_tmap_bf16_store) */
	CUtensorMap omap[3];
};

/* The output type tag of the products whose epilogue is SwiGLU's backward: C = dh (bf16-rounded as
 * a bf16 C would be) is not written; dg, du and the dot slots are (wg_put_swb). */
struct wg_swb {
	char unused;
};
template <typename OUT>
struct wg_is_swb {
	static constexpr bool v = false;
};
template <>
struct wg_is_swb<wg_swb> {
	static constexpr bool v = true;
};
#define WG_SWB_SLOT 128 /* the columns of a dot slot */

/* A tile of BM x BN: the bytes of a stage, the ring depth that fits, the columns WN of each
 * consumer warpgroup, its 64-row blocks MT and the output columns OBN of a tile.
 *  - PP 0 (cooperative): both consumers work on one tile, 64 rows each (BM 128: the two halves of M)
 *    or half its columns each (BM 64); they finish together, so the tensor cores idle while they
 *    store it.
 *  - PP 1 (ping-pong): each consumer works on a tile of its own, BM x BN, on the CTA's even or odd
 *    tiles in turn. The producer fills the ring in tile order, so one consumer's products run while
 *    the other stores its last tile: the stores hide behind the products. */
template <int BM_, int BN_, int MODE_, int PP_, int DBG_, int STG_, int TMA_ = 0, int CL_ = 1, int ST_ = 0>
struct wg_cfg {
	static constexpr int BM = BM_, BN = BN_, MODE = MODE_, PP = PP_;
	static constexpr int DBG = DBG_; /* a measurement knob: WG_DBG_* above (0: the real kernel) */
	static constexpr int STG = STG_; /* 1: the consumers stage bf16 outputs (g, u and h, or a bf16 C) */
	/* 1: one producer thread loads the main segment's stages (and those of extra segments with one
	 * half, but in gate/up) by TMA, the producer warpgroup the other segments' by cp.async; gate/up's
	 * B then holds BN / 2 gate rows, then BN / 2 up rows, so the accumulator's first WN / 2 columns
	 * are g and the rest u (whole tiles a consumer: WN = BN) */
	static constexpr int TMA = TMA_;
	/* 2: CTA pairs (clusters of 2) share B. The pair takes tiles of 2 BM rows, each CTA BM of them
	 * (the second may lie past the group's end: multiplied, never stored); each CTA loads its own A
	 * and half of B, multicast to both, so B crosses from L2 once for the pair. A stage's "empty"
	 * barrier then takes the consumer warps of both CTAs: neither half of B is overwritten before
	 * both have read the stage, and a stage's "full" barrier one arrival from the other CTA's producer
	 * (wg_pair_arrive). Extra segments load whole in each CTA. Cooperative 128-row TMA tiles. */
	static constexpr int CL = CL_;
	/* 1: bf16 outputs (beta 0) leave by TMA stores of 64 x 32 subtiles, issued by one thread of the
	 * consumer from two stagings in turn, so that the consumer goes back to its products while the
	 * stores drain (wg_put_st); a 64-row block that a group's end cuts goes out by the threads' own
	 * stores, as TMA does not stop at the group's end. */
	static constexpr int ST = ST_;
	/* 1: the tiles may be claimed from a counter (args::sched): cooperative one-CTA TMA kernels,
	 * whose producer thread can post each claim to the others and whose map kernel zeroes it */
	static constexpr int DYN = TMA && !PP && CL == 1 && DBG == WG_DBG_NONE;
	static constexpr int OBN = MODE == WG_GU ? BN / 2 : BN;
	static constexpr int WN = PP || BM == 128 ? BN : BN / 2;
	static constexpr int MT = PP ? BM / 64 : 1;
	static constexpr int EMPTY_ARRIVALS = (PP ? 4 : 8) * CL; /* warps that read a stage */
	typedef wg_args<MODE> args;
	static constexpr int A_BYTES = BM * WG_ROW, B_BYTES = BN * WG_ROW, STAGE = A_BYTES + B_BYTES;
	/* ints: tile0 and roff [E + 1] each, one partial sum per warp */
	static constexpr int TABLE = 2 * (TIER_MOE_MAX_EXPERTS + 1) + WG_THREADS / 32;
	/* besides the stages and their two barriers each: 1024 of slack to align the ring, the two
	 * ping-pong turn barriers, the consumers' output staging (only where used: it costs 64 x 256
	 * tiles a ring stage), the table */
	/* ... and the ring of claimed tiles: 8 bytes of alignment, a tile and two barriers a slot */
	static constexpr int SCHED = DYN ? 8 + 24 * WG_SCHED : 0;
	static constexpr int FIXED = 1024 + 16 + (ST ? 4 * WG_ST_BYTES : STG ? 2 * WG_OUT_BYTES : 0) + 4 * TABLE + SCHED;
	static constexpr int STAGES = (WG_SMEM - FIXED) / (STAGE + 16);
	static constexpr size_t BYTES = (size_t)FIXED + (size_t)STAGES * (STAGE + 16);
	static_assert(BM == 64 || BM == 128, "one consumer warpgroup per 64 rows, or both on 64");
	static_assert(WN == 128 || WN == 256, "the wgmma shapes below: m64n128k16, m64n256k16");
	static_assert(MT * WN / 2 <= 128, "accumulator registers a thread");
	static_assert(STAGES >= 3, "a stage loading while the consumers hold two");
	static_assert(BYTES <= WG_SMEM, "Hopper's shared memory per block");
	static_assert(!TMA || MODE != WG_GU || WN == BN, "TMA: g and u in one consumer");
	static_assert(CL == 1 || (CL == 2 && TMA && !PP && BM == 128 && DBG == WG_DBG_NONE), "pairs: cooperative "
		      "128-row tiles, TMA");
	static_assert(!ST || (STG && TMA && !PP && BM == 128 && CL == 1 && DBG == WG_DBG_NONE), "TMA stores: "
		      "cooperative 128-row tiles, TMA loads");
};

struct wg_tile {
	int e, row0, rend, col0; /* expert, first row, its group's end, first column */
};

/* A CTA's shared memory: the ring (1024-byte aligned: the swizzle is a function of the address
 * bits 4-9), its barriers and the tile table. */
struct wg_shared {
	uint32_t ring;  /* shared address of stage 0; stage s at ring + s STAGE, B after A */
	uint32_t full;  /* shared address of full[0]; full[s] at full + 8 s */
	uint32_t empty; /* the same for empty */
	uint32_t turn;  /* ping-pong: turn[g] at turn + 8 g completes when consumer g has issued a tile's products */
	unsigned char *out; /* consumer g's output staging at out + g WG_OUT_BYTES (16-byte aligned; CFG::STG) */
	int *tile0;     /* [E + 1]: the first row tile of expert e; tile0[E] = all row tiles */
	int *roff;      /* [E + 1]: the offsets */
	int *wsum;      /* [12]: the scan's warp totals */
	long long *tids; /* [WG_SCHED]: the ring of claimed tiles (CFG::DYN), 8-byte aligned after wsum */
	uint32_t tfull;  /* shared address of its "posted" barriers: tfull + 8 j */
	uint32_t tempty; /* and of its "read by every reader warp" barriers */
};

/* The first non-NULL of E device pointers, else alt (a tensor map's template needs some 16-byte
 * aligned base). */
static inline const void *wg_first(const void *const *w, int E, const void *alt)
{
	for (int e = 0; e < E; e++)
		if (w[e])
			return w[e];
	return alt;
}

/* The plain forward product on swapped operands (moe_wgmma_swap.cu: TIER_MOE_WGMMA_TILE=swap), its
 * arguments checked by moe_cuda_grouped_mm_sm90_segs, rows_bound > 0, the driver's TMA encoder there. */
extern "C" int moe_wg_swap_mm(tier_dev *dev, int E, int N, int K, const int32_t *d_off, int rows_bound,
			      const void *const *w, const void *x, void *c, int c_bf16, float alpha, float beta,
			      int ctas);

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_SM90A 1
#endif

#endif
