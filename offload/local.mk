## offload/local.mk - the movers: fences, worker pool, io_uring, CUDA copy streams and staging
libtier_la_SOURCES += offload/engine.c offload/submit.c offload/fence.c offload/fileio.c \
	offload/uring.c offload/cuda_path.c offload/cuda_feed.c offload/crc32c.c offload/offload_impl.h
tierinclude_HEADERS += include/tier/offload.h

if HAVE_CMOCKA
check_PROGRAMS += tests/test_offload
TESTS += tests/test_offload
tests_test_offload_SOURCES = tests/test_offload.c
tests_test_offload_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_offload_LDFLAGS = $(TESTLD)
endif

if HAVE_CMOCKA
check_PROGRAMS += tests/test_offload_cuda
TESTS += tests/test_offload_cuda
tests_test_offload_cuda_SOURCES = tests/test_offload_cuda.c
tests_test_offload_cuda_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_offload_cuda_LDFLAGS = $(TESTLD)
endif
