## attn/local.mk - causal attention with GQA and RoPE: CPU reference, CUDA kernels, tests
libtier_la_SOURCES += attn/attn.c attn/attn_cpu.c attn/attn_impl.h
tierinclude_HEADERS += include/tier/attn.h
if HAVE_CUDA
libtier_la_SOURCES += attn/attn_cuda.cu attn/attn_wgmma.cu attn/attn_wgmma_bwd.cu
endif
EXTRA_DIST += attn/attn_cuda.cu attn/attn_wgmma.cu attn/attn_wgmma_bwd.cu attn/attn_cu.cuh

if HAVE_CMOCKA
check_PROGRAMS += tests/test_attn tests/test_attn_cuda
TESTS += tests/test_attn tests/test_attn_cuda
tests_test_attn_SOURCES = tests/test_attn.c
tests_test_attn_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_attn_LDFLAGS = $(TESTLD)
tests_test_attn_cuda_SOURCES = tests/test_attn_cuda.c
tests_test_attn_cuda_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_attn_cuda_LDFLAGS = $(TESTLD)
endif
