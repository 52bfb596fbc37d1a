## loss/local.mk - chunked cut-cross-entropy loss: CPU reference, CUDA kernels, tests
libtier_la_SOURCES += loss/loss.c loss/loss_cpu.c loss/loss_impl.h
tierinclude_HEADERS += include/tier/loss.h
if HAVE_CUDA
libtier_la_SOURCES += loss/loss_cuda.cu
endif
EXTRA_DIST += loss/loss_cuda.cu

if HAVE_CMOCKA
check_PROGRAMS += tests/test_loss tests/test_loss_cuda
TESTS += tests/test_loss tests/test_loss_cuda
tests_test_loss_SOURCES = tests/test_loss.c tests/loss_ref.c tests/loss_ref.h
tests_test_loss_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_loss_LDFLAGS = $(TESTLD)
tests_test_loss_cuda_SOURCES = tests/test_loss_cuda.c tests/loss_ref.c tests/loss_ref.h
tests_test_loss_cuda_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_loss_cuda_LDFLAGS = $(TESTLD)
endif
