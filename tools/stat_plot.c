/* stat_plot.c - tier-stat report --plot: one image of a run drawn with cairo: (a) the expert
 * hotness heatmap (layer x expert, tokens over the run) with its color scale, (b) the hit rate of
 * each tier per step, (c) the bytes each link moved per step. PNG or SVG by the file's name. */
#include "config.h"
#include <math.h>
#include <stdio.h>
#include <string.h>
#include "stat_report.h"

#ifdef TIER_HAVE_CAIRO
#include <cairo/cairo.h>
#include <cairo/cairo-svg.h>

#define W 1200
#define H 1120

typedef struct { double x, y, w, h; } box;

static const double series_rgb[][3] = {
	{ 0.12, 0.47, 0.71 }, { 1.00, 0.50, 0.05 }, { 0.17, 0.63, 0.17 }, { 0.84, 0.15, 0.16 },
	{ 0.58, 0.40, 0.74 }, { 0.55, 0.34, 0.29 }, { 0.89, 0.47, 0.76 }, { 0.50, 0.50, 0.50 },
};

/* Viridis, five stops, linearly interpolated: dark blue (cold) to yellow (hot). */
static void heat_rgb(double v, double *r, double *g, double *b)
{
	static const double stop[5][3] = {
		{ 0.267, 0.005, 0.329 }, { 0.231, 0.322, 0.545 }, { 0.129, 0.569, 0.549 },
		{ 0.369, 0.788, 0.384 }, { 0.993, 0.906, 0.144 },
	};
	v = v < 0 ? 0 : v > 1 ? 1 : v;
	double p = v * 4;
	int i = p >= 4 ? 3 : (int)p;
	double f = p - i;
	*r = stop[i][0] + f * (stop[i + 1][0] - stop[i][0]);
	*g = stop[i][1] + f * (stop[i + 1][1] - stop[i][1]);
	*b = stop[i][2] + f * (stop[i + 1][2] - stop[i][2]);
}

static void text_at(cairo_t *cr, double x, double y, double size, double align, const char *s)
{
	cairo_text_extents_t e;
	cairo_set_font_size(cr, size);
	cairo_text_extents(cr, s, &e);
	cairo_move_to(cr, x - align * e.x_advance, y);
	cairo_show_text(cr, s);
}

static void text_up(cairo_t *cr, double x, double y, double size, const char *s)
{
	cairo_text_extents_t e;
	cairo_save(cr);
	cairo_set_font_size(cr, size);
	cairo_text_extents(cr, s, &e);
	cairo_move_to(cr, x, y + e.x_advance / 2);
	cairo_rotate(cr, -M_PI / 2);
	cairo_show_text(cr, s);
	cairo_restore(cr);
}

/* A "nice" tick step for about n ticks over span. */
static double tick_step(double span, int n)
{
	double raw = span / n, mag = pow(10, floor(log10(raw))), f = raw / mag;
	return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * mag;
}

/* Frame, ticks and labels of a panel whose data run over [x0, x1] x [y0, y1]. */
static void axes(cairo_t *cr, box b, double x0, double x1, double y0, double y1, const char *title,
		 const char *xlabel, const char *ylabel)
{
	char s[32];
	cairo_set_source_rgb(cr, 0, 0, 0);
	cairo_set_line_width(cr, 1);
	cairo_rectangle(cr, b.x, b.y, b.w, b.h);
	cairo_stroke(cr);
	text_at(cr, b.x + b.w / 2, b.y - 10, 15, 0.5, title);
	text_at(cr, b.x + b.w / 2, b.y + b.h + 38, 12, 0.5, xlabel);
	text_up(cr, b.x - 52, b.y + b.h / 2, 12, ylabel);
	double st = tick_step(x1 - x0, 8);
	for (double v = ceil(x0 / st) * st; v <= x1 + 1e-9 * st; v += st) {
		double x = b.x + (x1 > x0 ? (v - x0) / (x1 - x0) : 0.5) * b.w;
		cairo_move_to(cr, x, b.y + b.h);
		cairo_line_to(cr, x, b.y + b.h + 5);
		cairo_stroke(cr);
		snprintf(s, sizeof s, "%g", v);
		text_at(cr, x, b.y + b.h + 18, 11, 0.5, s);
	}
	st = tick_step(y1 - y0, 5);
	for (double v = ceil(y0 / st) * st; v <= y1 + 1e-9 * st; v += st) {
		double y = b.y + b.h - (y1 > y0 ? (v - y0) / (y1 - y0) : 0.5) * b.h;
		cairo_move_to(cr, b.x - 5, y);
		cairo_line_to(cr, b.x, y);
		cairo_stroke(cr);
		snprintf(s, sizeof s, "%g", v);
		text_at(cr, b.x - 8, y + 4, 11, 1, s);
	}
}

static void legend(cairo_t *cr, box b, int i, const char *name)
{
	double x = b.x + b.w - 150, y = b.y + 16 + 16 * i;
	cairo_set_source_rgb(cr, series_rgb[i % 8][0], series_rgb[i % 8][1], series_rgb[i % 8][2]);
	cairo_rectangle(cr, x, y - 8, 18, 8);
	cairo_fill(cr);
	cairo_set_source_rgb(cr, 0, 0, 0);
	text_at(cr, x + 24, y, 11, 0, name);
}

static void heatmap(cairo_t *cr, const report_log *g, box b)
{
	char s[64];
	int64_t mx = 0;
	for (size_t i = 0; i < (size_t)g->nmoe * g->experts; i++)
		mx = g->tokens[i] > mx ? g->tokens[i] : mx;
	if (!g->nmoe || !g->experts) {
		cairo_set_source_rgb(cr, 0, 0, 0);
		text_at(cr, b.x + b.w / 2, b.y + b.h / 2, 14, 0.5, "no MoE layer in the log");
	}
	double cw = g->experts ? b.w / g->experts : 0, ch = g->nmoe ? b.h / g->nmoe : 0;
	for (int i = 0; i < g->nmoe; i++)
		for (int e = 0; e < g->experts; e++) {
			double r, gr, bl;
			heat_rgb(mx ? (double)g->tokens[(size_t)i * g->experts + e] / (double)mx : 0, &r, &gr, &bl);
			cairo_set_source_rgb(cr, r, gr, bl);
			cairo_rectangle(cr, b.x + e * cw, b.y + i * ch, cw + 0.5, ch + 0.5);
			cairo_fill(cr);
		}
	/* Axes: experts left to right, layers top to bottom (labelled with their layer numbers). */
	axes(cr, b, 0, 0, 0, 0, "(a) expert hotness: tokens routed over the run", "expert", "MoE layer");
	int xs = g->experts > 16 ? (int)tick_step(g->experts, 16) : 1, ys = g->nmoe > 24 ? (int)tick_step(g->nmoe, 12) : 1;
	for (int e = 0; e < g->experts; e += xs) {
		snprintf(s, sizeof s, "%d", e);
		text_at(cr, b.x + (e + 0.5) * cw, b.y + b.h + 18, 10, 0.5, s);
	}
	for (int i = 0; i < g->nmoe; i += ys) {
		snprintf(s, sizeof s, "%d", g->layer[i]);
		text_at(cr, b.x - 8, b.y + (i + 0.5) * ch + 4, 10, 1, s);
	}
	/* The color scale. */
	box k = { b.x + b.w + 30, b.y, 22, b.h };
	for (int p = 0; p < (int)k.h; p++) {
		double r, gr, bl;
		heat_rgb(1.0 - p / k.h, &r, &gr, &bl);
		cairo_set_source_rgb(cr, r, gr, bl);
		cairo_rectangle(cr, k.x, k.y + p, k.w, 1.5);
		cairo_fill(cr);
	}
	cairo_set_source_rgb(cr, 0, 0, 0);
	cairo_rectangle(cr, k.x, k.y, k.w, k.h);
	cairo_stroke(cr);
	for (int q = 0; q <= 4; q++) {
		snprintf(s, sizeof s, "%.0f", (double)mx * (4 - q) / 4);
		text_at(cr, k.x + k.w + 5, k.y + q * k.h / 4 + 4, 10, 0, s);
	}
	text_at(cr, k.x + k.w / 2, k.y - 8, 11, 0.5, "tokens");
}

/* The per-step value of series l at row i (from row i - 1). */
typedef double (*series_fn)(const report_log *g, int l, int i);

static double hit_at(const report_log *g, int t, int i) { return report_hit_pct(g, t, i, i - 1); }
static double mb_at(const report_log *g, int l, int i)
{
	return (double)(g->rows[i].bytes[l] - g->rows[i - 1].bytes[l]) / 1e6;
}

/* Lines of the series in `on` over the steps; the first row is left out when there are more (its
 * counters include the loading of the weights). */
static void lines(cairo_t *cr, const report_log *g, box b, const int *on, int ns, series_fn f, double ymax,
		  const char *title, const char *ylabel, const char names[][32])
{
	int i0 = g->n > 1 ? 1 : 0;
	double x0 = g->rows[i0].step, x1 = g->rows[g->n - 1].step;
	if (x1 <= x0)
		x1 = x0 + 1;
	axes(cr, b, x0, x1, 0, ymax, title, "step", ylabel);
	for (int k = 0; k < ns; k++) {
		int l = on[k], pen = 0;
		cairo_set_source_rgb(cr, series_rgb[k % 8][0], series_rgb[k % 8][1], series_rgb[k % 8][2]);
		cairo_set_line_width(cr, 1.6);
		for (int i = i0 > 0 ? i0 : 1; i < g->n; i++) {
			double v = f(g, l, i);
			if (isnan(v)) {
				pen = 0;
				continue;
			}
			double x = b.x + (g->rows[i].step - x0) / (x1 - x0) * b.w, y = b.y + b.h - v / ymax * b.h;
			if (pen)
				cairo_line_to(cr, x, y);
			else
				cairo_move_to(cr, x, y);
			pen = 1;
		}
		cairo_stroke(cr);
		legend(cr, b, k, names[l]);
	}
	if (g->n < 2) {
		cairo_set_source_rgb(cr, 0, 0, 0);
		text_at(cr, b.x + b.w / 2, b.y + b.h / 2, 13, 0.5, "one step only: no per-step change to draw");
	}
}

static void draw(cairo_t *cr, const report_log *g, const char *dir)
{
	char title[512];
	cairo_set_source_rgb(cr, 1, 1, 1);
	cairo_paint(cr);
	cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
	cairo_set_source_rgb(cr, 0, 0, 0);
	snprintf(title, sizeof title, "tier run %.300s: steps %d..%d, %.1f s", dir, g->rows[0].step,
		 g->rows[g->n - 1].step, g->rows[g->n - 1].time_s);
	text_at(cr, W / 2.0, 32, 20, 0.5, title);
	heatmap(cr, g, (box){ 90, 80, 960, 400 });
	int on[TIER_STATS_NLINKS], ns = 0;
	for (int t = 0; t < TIER_STATS_NTIERS; t++)
		if (g->capacity[t])
			on[ns++] = t;
	lines(cr, g, (box){ 90, 570, 960, 190 }, on, ns, hit_at, 100, "(b) hit rate per tier (acquires that found "
	      "their data in the tier)", "hit %", g->tier);
	double mx = 0;
	ns = 0;
	for (int l = 0; l < TIER_STATS_NLINKS; l++) {
		if (!g->rows[g->n - 1].bytes[l])
			continue;
		on[ns++] = l;
		for (int i = 1; i < g->n; i++)
			mx = mb_at(g, l, i) > mx ? mb_at(g, l, i) : mx;
	}
	lines(cr, g, (box){ 90, 860, 960, 190 }, on, ns, mb_at, mx > 0 ? mx * 1.1 : 1, "(c) bytes moved per step per link",
	      "MB (1e6 B)", g->link);
}

int report_plot(const report_log *g, const char *dir, const char *file)
{
	size_t n = strlen(file);
	int svg = n >= 4 && !strcmp(file + n - 4, ".svg");
	cairo_surface_t *sf = svg ? cairo_svg_surface_create(file, W, H) : cairo_image_surface_create(CAIRO_FORMAT_RGB24, W, H);
	cairo_status_t st = cairo_surface_status(sf);
	if (st == CAIRO_STATUS_SUCCESS) {
		cairo_t *cr = cairo_create(sf);
		draw(cr, g, dir);
		st = cairo_status(cr);
		cairo_destroy(cr);
	}
	if (st == CAIRO_STATUS_SUCCESS && !svg)
		st = cairo_surface_write_to_png(sf, file);
	cairo_surface_finish(sf);
	if (st == CAIRO_STATUS_SUCCESS)
		st = cairo_surface_status(sf);
	cairo_surface_destroy(sf);
	cairo_debug_reset_static_data(); /* free cairo's font caches: leak checkers see a clean exit */
	if (st != CAIRO_STATUS_SUCCESS) {
		fprintf(stderr, "tier-stat report: --plot %s: %s; choose a writable path\n", file, cairo_status_to_string(st));
		return REPORT_BADLOG;
	}
	return 0;
}

#else

int report_plot(const report_log *g, const char *dir, const char *file)
{
	(void)g, (void)dir;
	fprintf(stderr, "tier-stat report: --plot %s: this tier-stat was built without cairo; install libcairo2-dev, then "
		"rerun configure and make\n", file);
	return REPORT_NOPLOT;
}

#endif
