## tier/local.mk - sources of tier/ (filled in by its issue)
libtier_la_SOURCES += tier/stats_shm.c
if HAVE_CMOCKA
check_PROGRAMS += tests/test_stats
TESTS += tests/test_stats
tests_test_stats_SOURCES = tests/test_stats.c
tests_test_stats_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_stats_LDFLAGS = $(TESTLD)
endif
## allocators and the memory behind each tier (backend)
libtier_la_SOURCES += tier/range.c tier/backend.c tier/backend_nvme.c tier/meta_alloc.c \
	tier/backend.h tier/backend_nvme.h tier/meta_alloc.h
if HAVE_CMOCKA
check_PROGRAMS += tests/test_range
TESTS += tests/test_range
tests_test_range_SOURCES = tests/test_range.c
tests_test_range_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_range_LDFLAGS = $(TESTLD)
check_PROGRAMS += tests/test_backend
TESTS += tests/test_backend
tests_test_backend_SOURCES = tests/test_backend.c
tests_test_backend_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_backend_LDFLAGS = $(TESTLD)
endif
## the store core: objects, copies, eviction, policies, hotness, prefetch (store)
libtier_la_SOURCES += tier/store.c tier/object.c tier/access.c tier/evict.c tier/hotness.c \
	tier/prefetch.c tier/policy.c tier/policy_recency.c tier/policy_cost.c tier/policy_schedule.c \
	tier/store_internal.h tier/policy.h
## access traces (docs/trace.md)
libtier_la_SOURCES += tier/trace.c tier/trace_read.c tier/trace_format.h
tierinclude_HEADERS += include/tier/store.h include/tier/stats.h
if HAVE_CMOCKA
check_PROGRAMS += tests/test_store_random tests/test_store_policy tests/test_store_errors tests/test_store_threads
TESTS += tests/test_store_random tests/test_store_policy tests/test_store_errors tests/test_store_threads
tests_test_store_random_SOURCES = tests/test_store_random.c tests/store_util.h
tests_test_store_random_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_store_random_LDFLAGS = $(TESTLD)
tests_test_store_policy_SOURCES = tests/test_store_policy.c tests/store_util.h
tests_test_store_policy_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_store_policy_LDFLAGS = $(TESTLD)
tests_test_store_errors_SOURCES = tests/test_store_errors.c tests/store_util.h
tests_test_store_errors_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_store_errors_LDFLAGS = $(TESTLD)
tests_test_store_threads_SOURCES = tests/test_store_threads.c tests/store_util.h
tests_test_store_threads_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_store_threads_LDFLAGS = $(TESTLD)
endif
## access traces: write/read round trip, bad files
if HAVE_CMOCKA
check_PROGRAMS += tests/test_trace
TESTS += tests/test_trace
tests_test_trace_SOURCES = tests/test_trace.c tests/store_util.h
tests_test_trace_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_trace_LDFLAGS = $(TESTLD)
endif
