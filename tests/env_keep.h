/* env_keep.h - a knob of the environment set for a while in a test, the run's own value (or its
 * absence) put back after: bench/validate-forms.sh runs the tests under such settings, which must
 * hold for the rest of the run. Include it after <cmocka.h> (a value too long to keep fails the
 * test rather than coming back cut). */
#ifndef TIER_TESTS_ENV_KEEP_H
#define TIER_TESTS_ENV_KEEP_H

#include <stdlib.h>
#include <string.h>

typedef struct {
	const char *name;
	int had;       /* the run set it (maybe to "") */
	char was[128]; /* its value then */
} env_keep;

/* name set to value, or unset where value is NULL; nothing kept. */
static inline void env_put(const char *name, const char *value)
{
	if (value)
		assert_int_equal(setenv(name, value, 1), 0);
	else
		assert_int_equal(unsetenv(name), 0);
}

/* name's value now (or its absence) kept in *k for env_back; the environment unchanged. */
static inline void env_save(env_keep *k, const char *name)
{
	const char *v = getenv(name);
	size_t n = v ? strlen(v) : 0;
	if (n >= sizeof k->was)
		fail_msg("$%s is %zu bytes, more than env_keep keeps (%zu)", name, n, sizeof k->was - 1);
	k->name = name, k->had = v != NULL;
	memcpy(k->was, v ? v : "", n + 1);
}

/* env_save, then name set to value (NULL unsets). */
static inline void env_set(env_keep *k, const char *name, const char *value)
{
	env_save(k, name);
	env_put(name, value);
}

/* The value env_save kept put back, or the knob unset where the run had none; nothing where k
 * (zeroed) kept nothing yet. */
static inline void env_back(const env_keep *k)
{
	if (k->name)
		env_put(k->name, k->had ? k->was : NULL);
}

/* name set to value (NULL unsets) for one setting of a sweep: the run's own value kept in k (zeroed
 * before the first) at the first setting only, so that env_back after any of them puts it back. */
static inline void env_sweep(env_keep *k, const char *name, const char *value)
{
	if (!k->name)
		env_save(k, name);
	env_put(name, value);
}

#endif
