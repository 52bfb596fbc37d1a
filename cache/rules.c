/* rules.c - which operator outputs may be cached: the job configuration's op-cache rules. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/cache.h"

static const char *const kind_names[TIER_NOPKINDS] = {
	"matmul", "grouped_gemm", "attention", "norm", "activation", "other",
};
static const char *const policy_names[TIER_NCACHE_POLICIES] = { "value", "fcfs", "off" };

const char *tier_op_kind_name(tier_op_kind k)
{
	return (unsigned)k < TIER_NOPKINDS ? kind_names[k] : "?";
}

const char *tier_cache_policy_name(tier_cache_policy p)
{
	return (unsigned)p < TIER_NCACHE_POLICIES ? policy_names[p] : "?";
}

int tier_op_kind_parse(const char *name, tier_op_kind *out)
{
	for (int k = 0; k < TIER_NOPKINDS; k++)
		if (!strcmp(name, kind_names[k])) {
			*out = (tier_op_kind)k;
			return 0;
		}
	return tier_fail(-EINVAL, "op-cache rules: unknown operator kind '%s': use matmul, grouped_gemm, attention, "
			 "norm, activation, other or all", name);
}

static int parse_u32(const char *s, const char **end, uint32_t *out)
{
	char *e;
	if (*s < '0' || *s > '9')
		return -1;
	errno = 0;
	unsigned long v = strtoul(s, &e, 10);
	if (errno || v > UINT32_MAX)
		return -1;
	*out = (uint32_t)v;
	*end = e;
	return 0;
}

/* One range: N, A-B or A-B/S. */
static int parse_range(const char *s, tier_cache_range *r)
{
	const char *e;
	if (parse_u32(s, &e, &r->lo))
		goto bad;
	r->hi = r->lo;
	r->stride = 1;
	if (*e == '-' && parse_u32(e + 1, &e, &r->hi))
		goto bad;
	if (*e == '/' && (parse_u32(e + 1, &e, &r->stride) || r->stride == 0))
		goto bad;
	if (*e || r->hi < r->lo)
		goto bad;
	return 0;
bad:
	return tier_fail(-EINVAL, "op-cache rules: bad layer range '%s': write N, A-B or A-B/S with A <= B and S >= 1", s);
}

static int parse_layers(char *text, tier_cache_rule *rule)
{
	rule->n_ranges = 0;
	if (!strcmp(text, "all"))
		return 0;
	char *save = NULL;
	for (char *tok = strtok_r(text, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		if (rule->n_ranges == TIER_CACHE_MAX_RANGES)
			return tier_fail(-EINVAL, "op-cache rules: more than %d layer ranges in one rule: split it into rules",
					 TIER_CACHE_MAX_RANGES);
		int rc = parse_range(tok, &rule->ranges[rule->n_ranges]);
		if (rc)
			return rc;
		rule->n_ranges++;
	}
	if (!rule->n_ranges)
		return tier_fail(-EINVAL, "op-cache rules: empty 'layers=': give ranges such as 0-47 or 'all'");
	return 0;
}

static int parse_kinds(char *text, unsigned *kinds)
{
	*kinds = 0;
	char *save = NULL;
	for (char *tok = strtok_r(text, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		tier_op_kind k = 0; /* set by the parse below; gcc cannot tell */
		if (!strcmp(tok, "all")) {
			*kinds = (1u << TIER_NOPKINDS) - 1;
			continue;
		}
		int rc = tier_op_kind_parse(tok, &k);
		if (rc)
			return rc;
		*kinds |= 1u << k;
	}
	if (!*kinds)
		return tier_fail(-EINVAL, "op-cache rules: a rule without operator kinds: start it with e.g. 'matmul'");
	return 0;
}

static int parse_option(tier_cache_config *cfg, const char *name, const char *val)
{
	if (!strcmp(name, "hbm") || !strcmp(name, "ddr")) {
		uint64_t v;
		int rc = tier_parse_size(val, &v);
		if (rc) {
			char why[160]; /* tier_fail writes the buffer tier_last_error reads */
			snprintf(why, sizeof why, "%s", tier_last_error());
			return tier_fail(rc, "op-cache rules: %s=%s: %s", name, val, why);
		}
		cfg->budget[name[0] == 'd'] = v;
		return 0;
	}
	if (!strcmp(name, "policy")) {
		for (int p = 0; p < TIER_NCACHE_POLICIES; p++)
			if (!strcmp(val, policy_names[p])) {
				cfg->policy = (tier_cache_policy)p;
				return 0;
			}
		return tier_fail(-EINVAL, "op-cache rules: unknown policy '%s': use value, fcfs or off", val);
	}
	return tier_fail(-EINVAL, "op-cache rules: unknown field '%s=': use layers, hbm, ddr or policy", name);
}

/* One clause: [KINDS][:layers=R][:hbm=S][:ddr=S][:policy=P]. */
static int parse_clause(tier_cache_config *cfg, char *clause)
{
	tier_cache_rule *rule = NULL;
	char *save = NULL;
	for (char *f = strtok_r(clause, ":", &save); f; f = strtok_r(NULL, ":", &save)) {
		char *eq = strchr(f, '=');
		int rc;
		if (!eq) {
			if (rule)
				return tier_fail(-EINVAL, "op-cache rules: '%s' after the kinds of a rule: start a new rule "
						 "after ';'", f);
			if (cfg->n_rules == TIER_CACHE_MAX_RULES)
				return tier_fail(-EINVAL, "op-cache rules: more than %d rules", TIER_CACHE_MAX_RULES);
			rule = &cfg->rules[cfg->n_rules++];
			memset(rule, 0, sizeof *rule);
			rc = parse_kinds(f, &rule->kinds);
		} else {
			*eq = 0;
			if (!strcmp(f, "layers")) {
				if (!rule)
					return tier_fail(-EINVAL, "op-cache rules: 'layers=' without operator kinds before it");
				rc = parse_layers(eq + 1, rule);
			} else {
				rc = parse_option(cfg, f, eq + 1);
			}
		}
		if (rc)
			return rc;
	}
	return 0;
}

int tier_cache_config_parse(const char *text, tier_cache_config *out)
{
	if (!text || !out)
		return tier_fail(-EINVAL, "op-cache rules: NULL text or output");
	size_t n = strlen(text);
	char *copy = malloc(n + 1);
	tier_cache_config *cfg = calloc(1, sizeof *cfg);
	int rc = 0;
	if (!copy || !cfg) {
		rc = tier_fail(-ENOMEM, "op-cache rules: out of memory");
		goto out;
	}
	memcpy(copy, text, n + 1);
	for (char *p = copy; *p; p++)
		if (*p == ' ' || *p == '\t' || *p == '\n')
			*p = ';'; /* whitespace separates clauses too */
	char *save = NULL;
	for (char *cl = strtok_r(copy, ";", &save); cl && !rc; cl = strtok_r(NULL, ";", &save))
		rc = parse_clause(cfg, cl);
	if (!rc)
		*out = *cfg;
out:
	free(copy);
	free(cfg);
	return rc;
}

static int range_has(const tier_cache_range *r, uint32_t layer)
{
	return layer >= r->lo && layer <= r->hi && (layer - r->lo) % r->stride == 0;
}

int tier_cache_rules_match(const tier_cache_config *cfg, tier_op_kind kind, uint32_t layer)
{
	if ((unsigned)kind >= TIER_NOPKINDS)
		return 0;
	for (unsigned i = 0; i < cfg->n_rules; i++) {
		const tier_cache_rule *r = &cfg->rules[i];
		if (!(r->kinds & 1u << kind))
			continue;
		if (!r->n_ranges)
			return 1;
		for (unsigned j = 0; j < r->n_ranges; j++)
			if (range_has(&r->ranges[j], layer))
				return 1;
	}
	return 0;
}
