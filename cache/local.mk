## cache/local.mk - the selective operator cache: admission by value density over the store.
libtier_la_SOURCES += cache/opcache.c cache/admit.c cache/rules.c cache/copy.c cache/opcache_internal.h
tierinclude_HEADERS += include/tier/cache.h
if HAVE_CMOCKA
check_PROGRAMS += tests/test_opcache
TESTS += tests/test_opcache
tests_test_opcache_SOURCES = tests/test_opcache.c
tests_test_opcache_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_opcache_LDFLAGS = $(TESTLD)
endif
