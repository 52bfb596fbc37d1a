## tests/local.mk - unit tests of base/ (each module's tests are listed in its own local.mk)
## the seed and CPU device of the CPU tests that draw random inputs (attn, loss, layers, train);
## every randomised test's seed (TIER_TEST_SEED)
EXTRA_DIST += tests/seeded_cpu.h tests/test_seed.h
## a knob set for a while by a test, the run's own value put back (attn, moe, ops, train)
EXTRA_DIST += tests/env_keep.h
if HAVE_CMOCKA
check_PROGRAMS += tests/test_base
TESTS += tests/test_base
tests_test_base_SOURCES = tests/test_base.c
tests_test_base_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_base_LDFLAGS = $(TESTLD)
endif

## Golden alignment with HF transformers + PEFT (fixtures: tests/golden/make_fixtures.py).
if HAVE_CMOCKA
check_PROGRAMS += tests/test_golden
TESTS += tests/test_golden
tests_test_golden_SOURCES = tests/test_golden.c
tests_test_golden_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_golden_LDFLAGS = $(TESTLD)
## the same on the trainer's CUDA path (bf16; skipped without a GPU)
check_PROGRAMS += tests/test_golden_cuda
TESTS += tests/test_golden_cuda
tests_test_golden_cuda_SOURCES = tests/test_golden.c
tests_test_golden_cuda_CPPFLAGS = $(AM_CPPFLAGS) -DGOLDEN_CUDA
tests_test_golden_cuda_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_golden_cuda_LDFLAGS = $(TESTLD)
endif
EXTRA_DIST += tests/golden/data tests/golden/make_fixtures.py tests/golden/check_peft_adapter.py \
	tests/golden/README.md
## The planted-LoRA recovery test: data from the base model plus a known
## low-rank delta; a fresh LoRA trained on it comes within 5% of the teacher's cross-entropy.
if HAVE_CMOCKA
check_PROGRAMS += tests/test_planted_lora
TESTS += tests/test_planted_lora
tests_test_planted_lora_SOURCES = tests/test_planted_lora.c
tests_test_planted_lora_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_planted_lora_LDFLAGS = $(TESTLD)
endif
