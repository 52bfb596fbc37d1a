## base/local.mk - errors, logging, sizes, random numbers, device context
libtier_la_SOURCES += base/error.c base/log.c base/size.c base/rng.c base/dev.c base/marks.c base/waypoint.c \
	base/blas.c base/blas.h base/gemm_cuda.h base/tmap_cuda.h base/fill_cuda.h
tierinclude_HEADERS += include/tier/base.h include/tier/tier.h
if HAVE_CUDA
libtier_la_SOURCES += base/gemm_cuda.cu base/tmap_cuda.cu base/fill_cuda.cu
endif
EXTRA_DIST += base/bf16x4.cuh base/cuda_reduce.cuh base/mma_sm80.cuh base/sm90.cuh base/pdl.cuh base/gemm_cuda.cu \
	base/tmap_cuda.cu base/fill_cuda.cu
