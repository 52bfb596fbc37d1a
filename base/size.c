/* size.c - parse and format byte sizes ("24G", "512M", "1.5TiB"). */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include "tier/base.h"

int tier_parse_size(const char *text, uint64_t *out)
{
	static const struct { const char *suffix; int shift; } units[] = {
		{ "", 0 }, { "b", 0 }, { "k", 10 }, { "kb", 10 }, { "kib", 10 }, { "m", 20 }, { "mb", 20 },
		{ "mib", 20 }, { "g", 30 }, { "gb", 30 }, { "gib", 30 }, { "t", 40 }, { "tb", 40 },
		{ "tib", 40 }, { "p", 50 }, { "pb", 50 }, { "pib", 50 },
	};
	char *end;
	double v;
	if (!text || !*text || isspace((unsigned char)*text) || *text == '-' || *text == '+')
		return tier_fail(-EINVAL, "size '%s': expected a number with an optional unit (e.g. 24G, 512M, 4096)",
				 text ? text : "(null)");
	errno = 0;
	v = strtod(text, &end);
	if (end == text || errno || !isfinite(v) || v < 0)
		return tier_fail(-EINVAL, "size '%s': expected a number with an optional unit (e.g. 24G, 512M, 4096)", text);
	for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
		if (strcasecmp(end, units[i].suffix))
			continue;
		double bytes = ldexp(v, units[i].shift);
		if (bytes >= 18446744073709551616.0)
			return tier_fail(-ERANGE, "size '%s' is larger than 2^64 bytes", text);
		if (bytes != floor(bytes))
			return tier_fail(-EINVAL, "size '%s' is not a whole number of bytes", text);
		*out = (uint64_t)bytes;
		return 0;
	}
	return tier_fail(-EINVAL, "size '%s': unknown unit '%s' (use K, M, G, T or P; binary, 1K = 1024)", text, end);
}

char *tier_format_size(uint64_t bytes, char *buf, size_t len)
{
	static const char *u[] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB" };
	double v = (double)bytes;
	int i = 0;
	while (v >= 1024.0 && i < 6) {
		v /= 1024.0;
		i++;
	}
	if (i == 0)
		snprintf(buf, len, "%llu B", (unsigned long long)bytes);
	else
		snprintf(buf, len, "%.2f %s", v, u[i]);
	return buf;
}
