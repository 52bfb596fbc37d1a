/* plan_calib.c - tier-plan --calibrate: rates measured by tier-bench replace a cluster's presets.
 *
 * Reads the text tier-bench prints: the h2d and nvme-read tables (rows "SIZE UNIT count time algbw
 * ...", under a "# tier-bench h2d:" or "# tier-bench nvme-read:" comment) and the one-line --json
 * results of attn and loss. The best rate of each kind is taken: a plan is a bound, and the largest
 * transfers and shapes are what a training step runs. */
#include "config.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/base.h"
#include "tier/plan.h"

enum { SEC_NONE, SEC_H2D, SEC_NVME };

/* algbw (GB/s) of a table row, or 0 when the line is not one. */
static double row_gbps(const char *line)
{
	char size[32], unit[16], count[32], time[32], bw[32];
	if (sscanf(line, " %31s %15s %31s %31s %31s", size, unit, count, time, bw) != 5)
		return 0;
	char *end;
	double v = strtod(bw, &end);
	return *end || strtod(size, &end) <= 0 ? 0 : v;
}

/* Best forward+backward TFLOP/s of the results in an attn or loss --json line. */
static double json_tflops(const char *line)
{
	int attn = strstr(line, "\"bench\":\"attn\"") != NULL;
	int dw = strstr(line, "\"dw\":1") != NULL;
	double best = 0;
	for (const char *s = strchr(line, '['); s && (s = strchr(s, '{')); s++) {
		long long b, sq, hh, kh, d, n, v;
		double fwd, bwd, fb, flop = 0;
		if (attn && sscanf(s, "{\"B\":%lld,\"S\":%lld,\"H\":%lld,\"KVH\":%lld,\"D\":%lld,\"fwd_ms\":%lf,"
				   "\"bwd_ms\":%lf,\"fwd_bwd_ms\":%lf", &b, &sq, &hh, &kh, &d, &fwd, &bwd, &fb) == 8)
			flop = 3.5 * 2.0 * (double)sq * sq * d * hh * b;   /* tier-bench attn's count */
		else if (!attn && sscanf(s, "{\"N\":%lld,\"V\":%lld,\"D\":%lld,\"fwd_ms\":%lf,\"bwd_ms\":%lf,"
					 "\"fwd_bwd_ms\":%lf", &n, &v, &d, &fwd, &bwd, &fb) == 6)
			flop = (dw ? 3 : 2) * 2.0 * (double)n * v * d;      /* tier-bench loss's count */
		if (flop > 0 && fb > 0 && flop / (fb * 1e9) > best)
			best = flop / (fb * 1e9);
	}
	return best;
}

int tier_plan_calibrate(const char *path, tier_plan_cluster *c, unsigned *found)
{
	if (!path)
		return tier_fail(-EINVAL, "no calibration file given");
	FILE *f = fopen(path, "r");
	if (!f) {
		int e = errno;
		return tier_fail(-e, "cannot read calibration file %s: %s", path, strerror(e));
	}
	char line[65536];
	int sec = SEC_NONE;
	double pcie = 0, nvme = 0, tf = 0;
	while (fgets(line, sizeof line, f)) {
		if (!strncmp(line, "# tier-bench ", 13)) {
			sec = !strncmp(line + 13, "h2d:", 4) ? SEC_H2D : !strncmp(line + 13, "nvme-read:", 10) ? SEC_NVME
												: SEC_NONE;
		} else if (line[0] == '{' && strstr(line, "\"bench\":")) {
			double t = json_tflops(line);
			tf = t > tf ? t : tf;
		} else if (line[0] != '#' && sec != SEC_NONE) {
			double bw = row_gbps(line);
			double *dst = sec == SEC_H2D ? &pcie : &nvme;
			*dst = bw > *dst ? bw : *dst;
		}
	}
	fclose(f);
	if (pcie <= 0 && nvme <= 0 && tf <= 0)
		return tier_fail(-EBADMSG, "%s holds no tier-bench output: run tier-bench h2d, nvme-read, and attn or "
				 "loss with --json, and save what they print", path);
	unsigned got = 0;
	if (pcie > 0) {
		c->pcie_gbps = pcie;
		got |= 1;
	}
	if (nvme > 0) {
		c->nvme_read_gbps = nvme * c->gpus_per_node;   /* one process measured; every GPU has its own */
		got |= 2;
	}
	if (tf > 0) {
		c->mfu = tf / c->tflops < 1 ? tf / c->tflops : 1;
		got |= 4;
	}
	if (found)
		*found = got;
	return 0;
}
