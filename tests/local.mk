## tests/local.mk - unit tests of base/ (each module's tests are listed in its own local.mk)
if HAVE_CMOCKA
check_PROGRAMS += tests/test_base
TESTS += tests/test_base
tests_test_base_SOURCES = tests/test_base.c
tests_test_base_LDADD = $(TEST_LIBS) $(CMOCKA_LIBS)
tests_test_base_LDFLAGS = $(TESTLD)
endif
