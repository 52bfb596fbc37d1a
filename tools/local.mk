## tools/local.mk - the programs: tier-stat (watch a job's store), tier-run (the LoRA trainer;
## `tier-run --store-demo` is the store demonstration), tier-bench (benchmarks, one subcommand per part).
bin_PROGRAMS += tier-stat tier-run tier-bench
tier_stat_SOURCES = tools/tier-stat.c tools/stat_ranks.c tools/stat_ranks.h tools/stat_report.c tools/stat_report.h tools/stat_plot.c
tier_stat_LDADD = libtier.la $(TIER_DEP_LIBS) $(CAIRO_LIBS)
tier_run_SOURCES = tools/tier-run.c tools/run_opts.c tools/run_opts.h tools/store_demo.c tools/stats_log.c tools/stats_log.h
tier_run_CPPFLAGS = $(AM_CPPFLAGS) -DTIER_PKGDATADIR='"$(pkgdatadir)"'
tier_run_LDADD = libtier.la $(TIER_DEP_LIBS)
dist_man1_MANS += man/tier-run.1
## tier-bench: one file per subcommand (add its function to the table in tools/tier-bench.c).
tier_bench_SOURCES = tools/tier-bench.c tools/bench.h tools/bench_util.c
tier_bench_SOURCES += tools/bench_store.c tools/bench_sched.c
tier_bench_SOURCES += tools/bench_loss.c
tier_bench_SOURCES += tools/bench_attn.c
tier_bench_SOURCES += tools/bench_offload.c
tier_bench_SOURCES += tools/bench_opcache.c tools/bench_opcache.h tools/bench_opcache_dev.c
tier_bench_SOURCES += tools/bench_prefetch.c tools/bench_prefetch.h tools/bench_prefetch_dev.c
tier_bench_SOURCES += tools/bench_moe.c tools/bench_fused.c tools/bench_lora.c tools/bench_dev.c tools/bench_dev.h
tier_bench_LDADD = libtier.la $(TIER_DEP_LIBS)
dist_man1_MANS += man/tier-stat.1

## End to end: a demo job watched by tier-stat, exit codes, tier-bench store. A script: no LDADD.
TESTS += tests/test_tools.sh
EXTRA_DIST += tests/test_tools.sh
TESTS += tests/test_prefetch_bench.sh
TESTS += tests/test_report.sh
EXTRA_DIST += tests/test_report.sh
## tier-stat on a job of several ranks (-p PID,PID, --run DIR with rankN/ or tier.N.pid)
TESTS += tests/test_stat_ranks.sh
EXTRA_DIST += tests/test_stat_ranks.sh
EXTRA_DIST += tests/test_prefetch_bench.sh

## tier-plan: cluster sizing (the arithmetic is core/plan*.c)
bin_PROGRAMS += tier-plan
tier_plan_SOURCES = tools/tier-plan.c
tier_plan_LDADD = libtier.la $(TIER_DEP_LIBS)
dist_man1_MANS += man/tier-plan.1
TESTS += tests/test_plan.sh
EXTRA_DIST += tests/test_plan.sh
## every option of the tools' --help in their man pages
TESTS += tests/test_man.sh
EXTRA_DIST += tests/test_man.sh

## tier-tune: replay a store access trace (tier-run --trace) against policies and capacities
bin_PROGRAMS += tier-tune
tier_tune_SOURCES = tools/tier-tune.c tools/tune_sim.c tools/tune_sim.h
tier_tune_LDADD = libtier.la $(TIER_DEP_LIBS)
dist_man1_MANS += man/tier-tune.1
TESTS += tests/test_tune.sh
EXTRA_DIST += tests/test_tune.sh
if HAVE_CMOCKA
check_PROGRAMS += tests/test_tune
TESTS += tests/test_tune
tests_test_tune_SOURCES = tests/test_tune.c tools/tune_sim.c tools/tune_sim.h
tests_test_tune_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_tune_LDFLAGS = $(TESTLD)
endif
EXTRA_DIST += docs/stats-log.md

## libtier-kprof.so: the kernel profiler that CUDA loads into a program through
## CUDA_INJECTION64_PATH (tools/kprof.c; CUPTI). A plain shared object, whatever libtool builds.
if HAVE_CUDA
noinst_DATA = tools/libtier-kprof.so
tools/libtier-kprof.so: $(top_srcdir)/tools/kprof.c $(top_srcdir)/tools/kprof_table.c $(top_srcdir)/tools/kprof_table.h
	@$(MKDIR_P) tools
	$(AM_V_CCLD)$(CC) -std=c11 -O2 -g -Wall -Wextra -Wno-unused-parameter -fPIC -shared -D_GNU_SOURCE \
		$(CUDA_CPPFLAGS) -I$(top_srcdir) -o $@ $(top_srcdir)/tools/kprof.c $(top_srcdir)/tools/kprof_table.c \
		-L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcupti -lstdc++ -lpthread
CLEANFILES += tools/libtier-kprof.so
endif
EXTRA_DIST += tools/kprof.c tools/kprof_table.c tools/kprof_table.h
if HAVE_CMOCKA
check_PROGRAMS += tests/test_kprof
TESTS += tests/test_kprof
tests_test_kprof_SOURCES = tests/test_kprof.c tools/kprof_table.c tools/kprof_table.h
tests_test_kprof_LDADD = $(CMOCKA_LIBS)
tests_test_kprof_LDFLAGS = $(TESTLD)
endif
