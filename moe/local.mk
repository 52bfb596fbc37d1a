## moe/local.mk - the MoE block: router, permute, grouped SwiGLU experts, combine (CPU fp32 reference, CUDA bf16)
libtier_la_SOURCES += moe/gemm.c moe/router.c moe/permute.c moe/experts.c moe/combine.c moe/layer.c \
	moe/moe_internal.h moe/moe_cuda.h moe/moe_wgmma.h moe/moe_skinny.h
tierinclude_HEADERS += include/tier/moe.h
if HAVE_CUDA
libtier_la_SOURCES += moe/moe.cu moe/moe_bwd.cu moe/moe_experts.cu moe/moe_experts_grouped.cu moe/moe_grouped.cu moe/moe_layer.cu \
	moe/moe_wgmma.cu moe/moe_wgmma_swap.cu moe/moe_skinny.cu moe/moe_wgrad.cu
endif
EXTRA_DIST += moe/moe_cu.cuh moe/moe_swiglu.cuh moe/moe_wgmma_cfg.cuh moe/moe_wgmma_ptx.cuh moe/moe_wgmma_store.cuh moe/moe.cu moe/moe_bwd.cu moe/moe_experts.cu moe/moe_experts_grouped.cu moe/moe_grouped.cu moe/moe_layer.cu \
	moe/moe_wgmma.cu moe/moe_wgmma_swap.cu moe/moe_skinny.cu moe/moe_wgrad.cu

if HAVE_CMOCKA
check_PROGRAMS += tests/test_moe_router tests/test_moe_permute tests/test_moe_experts tests/test_moe_layer \
	tests/test_moe_cuda
TESTS += tests/test_moe_router tests/test_moe_permute tests/test_moe_experts tests/test_moe_layer \
	tests/test_moe_cuda
tests_test_moe_router_SOURCES = tests/test_moe_router.c tests/moe_ref.h
tests_test_moe_router_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_moe_router_LDFLAGS = $(TESTLD)
tests_test_moe_permute_SOURCES = tests/test_moe_permute.c tests/moe_ref.h
tests_test_moe_permute_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_moe_permute_LDFLAGS = $(TESTLD)
tests_test_moe_experts_SOURCES = tests/test_moe_experts.c tests/moe_ref.h
tests_test_moe_experts_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_moe_experts_LDFLAGS = $(TESTLD)
tests_test_moe_layer_SOURCES = tests/test_moe_layer.c tests/moe_ref.h
tests_test_moe_layer_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_moe_layer_LDFLAGS = $(TESTLD)
tests_test_moe_cuda_SOURCES = tests/test_moe_cuda.c tests/moe_ref.h
tests_test_moe_cuda_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_moe_cuda_LDFLAGS = $(TESTLD)
endif

## The Hopper grouped GEMM (wgmma; skipped without a compute capability 9.0 GPU)
if HAVE_CMOCKA
check_PROGRAMS += tests/test_moe_wgmma
TESTS += tests/test_moe_wgmma
tests_test_moe_wgmma_SOURCES = tests/test_moe_wgmma.c tests/moe_ref.h
tests_test_moe_wgmma_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_moe_wgmma_LDFLAGS = $(TESTLD)

## The dh product with SwiGLU's backward in its epilogue, against the two steps it replaces
check_PROGRAMS += tests/test_moe_dh_swiglu
TESTS += tests/test_moe_dh_swiglu
tests_test_moe_dh_swiglu_SOURCES = tests/test_moe_dh_swiglu.c tests/moe_ref.h
tests_test_moe_dh_swiglu_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_moe_dh_swiglu_LDFLAGS = $(TESTLD)
endif

## The LoRA rank products (skinny grouped GEMM; skipped without a CUDA GPU)
if HAVE_CMOCKA
check_PROGRAMS += tests/test_moe_skinny
TESTS += tests/test_moe_skinny
tests_test_moe_skinny_SOURCES = tests/test_moe_skinny.c tests/moe_ref.h
tests_test_moe_skinny_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_moe_skinny_LDFLAGS = $(TESTLD)
endif
