## core/local.mk - sources of core/: Hugging Face formats (safetensors, config.json, PEFT), atomic files
libtier_la_SOURCES += core/dtype.c core/atomic_file.c core/safetensors.c core/safetensors_write.c \
	core/safetensors_int.h core/hf_checkpoint.c core/hf_config.c core/peft.c
tierinclude_HEADERS += include/tier/formats.h

if HAVE_CMOCKA
check_PROGRAMS += tests/test_dtype tests/test_safetensors tests/test_hf_config tests/test_peft
TESTS += tests/test_dtype tests/test_safetensors tests/test_hf_config tests/test_peft
tests_test_dtype_SOURCES = tests/test_dtype.c
tests_test_dtype_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_dtype_LDFLAGS = $(TESTLD)
tests_test_safetensors_SOURCES = tests/test_safetensors.c
tests_test_safetensors_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_safetensors_LDFLAGS = $(TESTLD)
tests_test_hf_config_SOURCES = tests/test_hf_config.c
tests_test_hf_config_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_hf_config_LDFLAGS = $(TESTLD)
tests_test_peft_SOURCES = tests/test_peft.c
tests_test_peft_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_peft_LDFLAGS = $(TESTLD)
endif

## Each fuzz target's standalone driver replays its seed corpus (tests/fuzz/corpus_NAME) as an
## ordinary test; docs/formats.md ("Testing") runs them under libFuzzer.
FUZZ_TARGETS = tests/fuzz/fuzz_safetensors tests/fuzz/fuzz_hf_config tests/fuzz/fuzz_ckpt_index \
	tests/fuzz/fuzz_peft tests/fuzz/fuzz_opcache_rules tests/fuzz/fuzz_data tests/fuzz/fuzz_run_config
check_PROGRAMS += $(FUZZ_TARGETS)
TESTS += $(FUZZ_TARGETS)
tests_fuzz_fuzz_safetensors_SOURCES = tests/fuzz/fuzz_safetensors.c tests/fuzz/fuzz_main.c
tests_fuzz_fuzz_safetensors_LDADD = $(TEST_LIBS)
tests_fuzz_fuzz_safetensors_LDFLAGS = $(TESTLD)
tests_fuzz_fuzz_hf_config_SOURCES = tests/fuzz/fuzz_hf_config.c tests/fuzz/fuzz_main.c tests/fuzz/fuzz_files.h
tests_fuzz_fuzz_hf_config_LDADD = $(TEST_LIBS)
tests_fuzz_fuzz_hf_config_LDFLAGS = $(TESTLD)
tests_fuzz_fuzz_ckpt_index_SOURCES = tests/fuzz/fuzz_ckpt_index.c tests/fuzz/fuzz_main.c tests/fuzz/fuzz_files.h
tests_fuzz_fuzz_ckpt_index_LDADD = $(TEST_LIBS)
tests_fuzz_fuzz_ckpt_index_LDFLAGS = $(TESTLD)
tests_fuzz_fuzz_peft_SOURCES = tests/fuzz/fuzz_peft.c tests/fuzz/fuzz_main.c tests/fuzz/fuzz_files.h
tests_fuzz_fuzz_peft_LDADD = $(TEST_LIBS)
tests_fuzz_fuzz_peft_LDFLAGS = $(TESTLD)
tests_fuzz_fuzz_opcache_rules_SOURCES = tests/fuzz/fuzz_opcache_rules.c tests/fuzz/fuzz_main.c
tests_fuzz_fuzz_opcache_rules_LDADD = $(TEST_LIBS)
tests_fuzz_fuzz_opcache_rules_LDFLAGS = $(TESTLD)
tests_fuzz_fuzz_data_SOURCES = tests/fuzz/fuzz_data.c tests/fuzz/fuzz_main.c tests/fuzz/fuzz_files.h
tests_fuzz_fuzz_data_LDADD = $(TEST_LIBS)
tests_fuzz_fuzz_data_LDFLAGS = $(TESTLD)
tests_fuzz_fuzz_run_config_SOURCES = tests/fuzz/fuzz_run_config.c tests/fuzz/fuzz_main.c tests/fuzz/fuzz_files.h \
	tools/run_opts.c tools/run_opts.h
tests_fuzz_fuzz_run_config_CPPFLAGS = $(AM_CPPFLAGS) -I$(srcdir)/tools
tests_fuzz_fuzz_run_config_LDADD = $(TEST_LIBS)
tests_fuzz_fuzz_run_config_LDFLAGS = $(TESTLD)
EXTRA_DIST += tests/fuzz/corpus_safetensors tests/fuzz/corpus_hf_config tests/fuzz/corpus_ckpt_index \
	tests/fuzz/corpus_peft tests/fuzz/corpus_opcache_rules tests/fuzz/corpus_data \
	tests/fuzz/corpus_run_config tests/golden/check_safetensors.py

## the trainer: layers, the qwen3_moe model in the store, the step, data
libtier_la_SOURCES += core/core_internal.h core/layers.c core/model.c core/model_io.c core/decoder.h \
	core/decoder.c core/dec_ops.h core/dec_ops.c core/trainer.h core/train.c core/train_sched.c core/train_optim.c \
	core/train_cache.c core/train_pending.c core/checkpoint.c core/data.c
tierinclude_HEADERS += include/tier/model.h
## the trainer's CUDA operations (stubs that return -ENOTSUP without CUDA)
libtier_la_SOURCES += core/ops_cuda.h core/ops_cat.c
if HAVE_CUDA
libtier_la_SOURCES += core/ops_cuda.cu core/ops_qk_cuda.cu
else
libtier_la_SOURCES += core/ops_nocuda.c
endif
EXTRA_DIST += core/ops_cuda.cu core/ops_qk_cuda.cu
if HAVE_CMOCKA
check_PROGRAMS += tests/test_ops_cuda
TESTS += tests/test_ops_cuda
tests_test_ops_cuda_SOURCES = tests/test_ops_cuda.c
tests_test_ops_cuda_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_ops_cuda_LDFLAGS = $(TESTLD)
endif
## tier-plan's arithmetic (cluster sizing)
libtier_la_SOURCES += core/plan_model.c core/plan.c core/plan_calib.c
tierinclude_HEADERS += include/tier/plan.h
if HAVE_CMOCKA
check_PROGRAMS += tests/test_plan
TESTS += tests/test_plan
tests_test_plan_SOURCES = tests/test_plan.c
tests_test_plan_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_plan_LDFLAGS = $(TESTLD)
endif
EXTRA_DIST += docs/plan.md
if HAVE_CMOCKA
check_PROGRAMS += tests/test_layers tests/test_train
TESTS += tests/test_layers tests/test_train
tests_test_layers_SOURCES = tests/test_layers.c
tests_test_layers_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_layers_LDFLAGS = $(TESTLD)
tests_test_train_SOURCES = tests/test_train.c
tests_test_train_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_train_LDFLAGS = $(TESTLD)
endif
## the default job's corpus (installed for tier-run) and its generator
dist_pkgdata_DATA = data/corpus.txt
EXTRA_DIST += data/make_corpus.py docs/trainer.md docs/data.md
## tier-run's training job end to end (a script: no LDADD)
TESTS += tests/test_run.sh
EXTRA_DIST += tests/test_run.sh
