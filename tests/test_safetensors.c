/* test_safetensors.c - safetensors round trips, sharded checkpoints, expert layouts, atomic writes,
 * and every kind of malformed header. */
#include <dirent.h>
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cmocka.h>
#include "config.h"
#include "tier/tier.h"
#include "test_seed.h"

static uint64_t seed;
static char dir[64];

static char *path_in(const char *name)
{
	static char p[4][256];
	static int k;
	k = (k + 1) % 4;
	snprintf(p[k], sizeof p[k], "%s/%s", dir, name);
	return p[k];
}

/* A file from a header text and `data` bytes of pattern data. */
static void write_raw(const char *path, const char *hdr, uint64_t hlen_claimed, size_t data)
{
	FILE *f = fopen(path, "wb");
	uint64_t n = hlen_claimed ? hlen_claimed : strlen(hdr);
	unsigned char len8[8], *buf = malloc(data + 1);
	assert_non_null(f);
	for (int i = 0; i < 8; i++)
		len8[i] = (unsigned char)(n >> (8 * i));
	tier_pattern_fill(buf, data, 7, 0);
	assert_int_equal(fwrite(len8, 1, 8, f), 8);
	assert_int_equal(fwrite(hdr, 1, strlen(hdr), f), strlen(hdr));
	assert_int_equal(fwrite(buf, 1, data, f), data);
	fclose(f);
	free(buf);
}

static void test_round_trip_every_dtype(void **state)
{
	enum { N = 2 * TIER_DT_COUNT };
	tier_st_wtensor t[N];
	char names[N][32];
	void *data[N];
	tier_rng r;
	tier_st *st = NULL;
	const char *meta[] = { "format", "pt", "note", "round trip", NULL };
	(void)state;
	tier_rng_seed(&r, seed);
	for (int i = 0; i < N; i++) {
		tier_st_wtensor *w = &t[i];
		memset(w, 0, sizeof *w);
		snprintf(names[i], sizeof names[i], "layer.%d.w%d", (int)tier_rng_below(&r, 50), i);
		w->name = names[i];
		w->dtype = (tier_dtype)(i % TIER_DT_COUNT);
		w->ndim = (int)tier_rng_below(&r, 4);           /* 0-d scalars included */
		uint64_t numel = 1;
		for (int d = 0; d < w->ndim; d++) {
			w->shape[d] = i == 5 && d == 0 ? 0 : 1 + tier_rng_below(&r, 7);   /* one empty tensor */
			numel *= w->shape[d];
		}
		size_t bytes = numel * tier_dtype_size(w->dtype);
		data[i] = malloc(bytes + 1);
		tier_pattern_fill(data[i], bytes, seed + (uint64_t)i, 0);
		w->data = data[i];
	}
	const char *p = path_in("rt.safetensors");
	assert_int_equal(tier_st_write(p, t, N, meta), 0);
	assert_int_equal(tier_st_open(p, &st), 0);
	assert_int_equal(tier_st_count(st), N);
	assert_string_equal(tier_st_metadata(st, "note"), "round trip");
	assert_null(tier_st_metadata(st, "absent"));
	for (int i = 0; i < N; i++) {
		const tier_st_tensor *x = tier_st_find(st, names[i]);
		assert_non_null(x);
		assert_int_equal(x->dtype, t[i].dtype);
		assert_int_equal(x->ndim, t[i].ndim);
		for (int d = 0; d < x->ndim; d++)
			assert_true(x->shape[d] == t[i].shape[d]);
		unsigned char *got = malloc(x->nbytes + 1);
		memset(got, 0xAA, x->nbytes + 1);
		assert_int_equal(tier_st_read(st, names[i], got, x->nbytes), 0);
		assert_int_equal(tier_pattern_check(got, x->nbytes, seed + (uint64_t)i, 0), x->nbytes);
		free(got);
		free(data[i]);
	}
	/* The header is padded so the data starts 8-byte aligned. */
	assert_int_equal(tier_st_at(st, 0)->offset % 8, 0);
	tier_st_close(st);
}

static void test_read_and_convert(void **state)
{
	enum { R = 3, C = 37 };
	float f[R * C], got[R * C];
	uint16_t b[R * C];
	tier_rng r;
	tier_st *st;
	(void)state;
	tier_rng_seed(&r, seed + 2);
	for (int i = 0; i < R * C; i++) {
		f[i] = tier_rng_normal(&r);
		b[i] = tier_f32_to_bf16(f[i]);
	}
	tier_st_wtensor t[2] = {
		{ .name = "b", .dtype = TIER_DT_BF16, .ndim = 2, .shape = { R, C }, .data = b },
		{ .name = "f", .dtype = TIER_DT_F32, .ndim = 2, .shape = { R, C }, .data = f },
	};
	const char *p = path_in("conv.safetensors");
	assert_int_equal(tier_st_write(p, t, 2, NULL), 0);
	assert_int_equal(tier_st_open(p, &st), 0);
	memset(got, 0xAA, sizeof got);
	assert_int_equal(tier_st_convert(st, "b", got, TIER_DT_F32, R * C), 0);
	for (int i = 0; i < R * C; i++)
		assert_true(got[i] == tier_bf16_to_f32(b[i]));
	uint16_t h[R * C];
	assert_int_equal(tier_st_convert(st, "f", h, TIER_DT_F16, R * C), 0);
	for (int i = 0; i < R * C; i++)
		assert_int_equal(h[i], tier_f32_to_f16(f[i]));
	/* A slice of a row. */
	const tier_st_tensor *x = tier_st_find(st, "f");
	assert_int_equal(tier_st_read_range(st, x, 4 * (C + 3), got, 4 * 5), 0);
	assert_memory_equal(got, f + C + 3, 4 * 5);
	/* Misuse. */
	assert_int_equal(tier_st_read(st, "f", got, 4), -EINVAL);
	assert_int_equal(tier_st_read(st, "nope", got, 4), -ENOENT);
	assert_non_null(strstr(tier_last_error(), "nope"));
	assert_int_equal(tier_st_read_range(st, x, x->nbytes - 2, got, 4), -EINVAL);
	assert_int_equal(tier_st_convert(st, "f", got, TIER_DT_F32, 5), -EINVAL);
	tier_st_close(st);
}

static void test_write_rejects(void **state)
{
	float v[2] = { 1, 2 };
	tier_st_wtensor t[2] = {
		{ .name = "a", .dtype = TIER_DT_F32, .ndim = 1, .shape = { 2 }, .data = v },
		{ .name = "a", .dtype = TIER_DT_F32, .ndim = 1, .shape = { 2 }, .data = v },
	};
	const char *p = path_in("rej.safetensors");
	(void)state;
	assert_int_equal(tier_st_write(p, t, 2, NULL), -EINVAL);
	assert_non_null(strstr(tier_last_error(), "twice"));
	t[1].name = "__metadata__";
	assert_int_equal(tier_st_write(p, t, 2, NULL), -EINVAL);
	t[1].name = "b";
	t[1].shape[0] = UINT64_MAX / 2;
	assert_int_equal(tier_st_write(p, t, 2, NULL), -EOVERFLOW);
	assert_int_equal(access(p, F_OK), -1);           /* nothing was published */
	assert_int_equal(tier_st_write(path_in("no-such-dir/x.safetensors"), t, 1, NULL), -ENOENT);
}

struct bad_case {
	const char *what;
	const char *hdr;
	uint64_t claimed_len;   /* 0: the header's length */
	size_t data;
	int rc;
	const char *tensor;     /* must appear in the message, or NULL */
	const char *problem;    /* must appear in the message */
};

static void test_malformed(void **state)
{
	static const struct bad_case cases[] = {
		{ "length beyond file", "{}", 1000, 0, -EBADMSG, NULL, "beyond the file" },
		{ "not JSON", "{\"w\": {\"dtype\": ", 0, 0, -EBADMSG, NULL, "not valid JSON" },
		{ "not an object", "[1, 2]", 0, 0, -EBADMSG, NULL, "not an object" },
		{ "empty header", "", 0, 0, -EBADMSG, NULL, "not valid JSON" },
		{ "newer dtype", "{\"w\": {\"dtype\": \"F8_E8M0\", \"shape\": [1], \"data_offsets\": [0, 1]}}", 0, 1,
		  -ENOTSUP, "w", "does not support its dtype F8_E8M0" },
		{ "trailing garbage", "{} x", 0, 0, -EBADMSG, NULL, "not valid JSON" },
		{ "not UTF-8", "{\"w\xff\": 1}", 0, 0, -EBADMSG, NULL, "not valid JSON" },
		{ "entry not object", "{\"w\": 3}", 0, 0, -EBADMSG, "w", "not a JSON object" },
		{ "missing field", "{\"w\": {\"dtype\": \"F32\", \"shape\": [1]}}", 0, 4, -EBADMSG, "w", "data_offsets" },
		{ "unknown dtype", "{\"w\": {\"dtype\": \"F33\", \"shape\": [1], \"data_offsets\": [0, 4]}}", 0, 4,
		  -EBADMSG, "w", "unknown dtype F33" },
		{ "shape/offset mismatch", "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 4]}}",
		  0, 4, -EBADMSG, "w", "give 8 bytes but data_offsets span 4" },
		{ "offsets beyond file", "{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
		  0, 2, -EBADMSG, "w", "beyond the data region" },
		{ "begin > end", "{\"w\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [4, 0]}}",
		  0, 4, -EBADMSG, "w", "begin 4 > end 0" },
		{ "offsets arity", "{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4, 8]}}",
		  0, 4, -EBADMSG, "w", "two non-negative" },
		{ "overlap", "{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
		  " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}", 0, 12, -EBADMSG, "b",
		  "overlap tensor 'a'" },
		{ "hole", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
		  " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 12]}}", 0, 12, -EBADMSG, "b",
		  "hole of 4 bytes" },
		{ "hole at start", "{\"a\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [3, 4]}}", 0, 4,
		  -EBADMSG, "a", "hole of 3 bytes" },
		{ "bytes after last", "{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}",
		  0, 8, -EBADMSG, "a", "4 bytes after the last tensor" },
		{ "negative shape", "{\"w\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}",
		  0, 4, -EBADMSG, "w", "non-negative integers" },
		{ "real shape", "{\"w\": {\"dtype\": \"F32\", \"shape\": [1.0], \"data_offsets\": [0, 4]}}",
		  0, 4, -EBADMSG, "w", "non-negative integers" },
		{ "huge shape", "{\"w\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296], "
		  "\"data_offsets\": [0, 4]}}", 0, 4, -EOVERFLOW, "w", "overflows" },
		{ "too many dims", "{\"w\": {\"dtype\": \"U8\", \"shape\": [1,1,1,1,1,1,1,1,1], "
		  "\"data_offsets\": [0, 1]}}", 0, 1, -ENOTSUP, "w", "9 dimensions" },
		{ "duplicate names", "{\"w\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]},"
		  " \"w\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [1, 2]}}", 0, 2, -EBADMSG, "\"w\"",
		  "duplicate" },
		{ "metadata not object", "{\"__metadata__\": [\"a\"]}", 0, 0, -EBADMSG, NULL, "__metadata__ is not" },
		{ "metadata value", "{\"__metadata__\": {\"format\": 1}}", 0, 0, -EBADMSG, "format",
		  "values must be strings" },
	};
	(void)state;
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		const struct bad_case *c = &cases[i];
		char name[64];
		tier_st *st = (tier_st *)&st;
		snprintf(name, sizeof name, "bad-%02zu.safetensors", i);
		const char *p = path_in(name);
		write_raw(p, c->hdr, c->claimed_len, c->data);
		int rc = tier_st_open(p, &st);
		const char *msg = tier_last_error();
		if (rc != c->rc || st != NULL || !strstr(msg, p) || (c->tensor && !strstr(msg, c->tensor)) ||
		    !strstr(msg, c->problem))
			fail_msg("case '%s': rc %d (want %d), message \"%s\"", c->what, rc, c->rc, msg);
	}
}

static void test_file_errors(void **state)
{
	tier_st *st = (tier_st *)&st;
	const char *p = path_in("short.safetensors");
	FILE *f = fopen(p, "wb");
	(void)state;
	fwrite("\x02\0\0", 1, 3, f);
	fclose(f);
	assert_int_equal(tier_st_open(p, &st), -EBADMSG);
	assert_null(st);
	assert_non_null(strstr(tier_last_error(), "fewer than the 8-byte"));
	assert_int_equal(tier_st_open(path_in("absent.safetensors"), &st), -ENOENT);
	assert_non_null(strstr(tier_last_error(), "absent.safetensors"));
	assert_int_equal(tier_st_open(dir, &st), -EINVAL);
	/* A header with padding spaces is fine; an empty file set is fine. */
	write_raw(p, "{\"a\": {\"dtype\": \"BOOL\", \"shape\": [], \"data_offsets\": [0, 1]}}   ", 0, 1);
	assert_int_equal(tier_st_open(p, &st), 0);
	assert_int_equal(tier_st_count(st), 1);
	assert_int_equal(tier_st_at(st, 0)->ndim, 0);
	tier_st_close(st);
	write_raw(p, " {\"__metadata__\": null}", 0, 0);     /* as the reference reads them */
	assert_int_equal(tier_st_open(p, &st), 0);
	assert_int_equal(tier_st_count(st), 0);
	tier_st_close(st);
	/* The in-memory parser has no file behind it. */
	unsigned char hdr[] = "\x0a\0\0\0\0\0\0\0{\"__metadata__\":{}}";
	hdr[0] = (unsigned char)(sizeof hdr - 9);
	assert_int_equal(tier_st_parse_header(hdr, sizeof hdr - 1, sizeof hdr - 1, "mem", &st), 0);
	tier_st_close(st);
	assert_int_equal(tier_st_parse_header(hdr, 12, sizeof hdr - 1, "mem", &st), -EINVAL);
}

/* ---- Checkpoints --------------------------------------------------------------------------- */

static void write_f32(const char *path, const char *const *names, size_t n, uint64_t rows, uint64_t cols)
{
	tier_st_wtensor t[16];
	float *d = malloc(rows * cols * 4 * n + 4);
	assert_true(n <= 16);
	for (size_t i = 0; i < n; i++) {
		for (uint64_t k = 0; k < rows * cols; k++)
			d[i * rows * cols + k] = (float)(i * 1000 + k);
		t[i] = (tier_st_wtensor){ .name = names[i], .dtype = TIER_DT_F32, .ndim = 2, .shape = { rows, cols },
					  .data = d + i * rows * cols };
	}
	assert_int_equal(tier_st_write(path, t, n, NULL), 0);
	free(d);
}

static void write_text(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");
	assert_non_null(f);
	fputs(text, f);
	fclose(f);
}

static void test_sharded(void **state)
{
	static const char *const s1[] = { "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight" };
	static const char *const s2[] = { "model.layers.1.self_attn.q_proj.weight", "lm_head.weight" };
	const tier_st *st;
	const tier_st_tensor *t;
	tier_ckpt *ck = (tier_ckpt *)&ck;
	(void)state;
	mkdir(path_in("sharded"), 0755);
	write_f32(path_in("sharded/model-00001-of-00002.safetensors"), s1, 2, 3, 5);
	write_f32(path_in("sharded/model-00002-of-00002.safetensors"), s2, 2, 3, 5);
	char idx[256];
	snprintf(idx, sizeof idx, "%s", path_in("sharded/model.safetensors.index.json"));
	write_text(idx, "{\"metadata\": {\"total_size\": 240}, \"weight_map\": {"
		   "\"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\","
		   "\"model.layers.0.self_attn.q_proj.weight\": \"model-00001-of-00002.safetensors\","
		   "\"model.layers.1.self_attn.q_proj.weight\": \"model-00002-of-00002.safetensors\","
		   "\"lm_head.weight\": \"model-00002-of-00002.safetensors\"}}");
	assert_int_equal(tier_ckpt_open(path_in("sharded"), &ck), 0);
	assert_int_equal(tier_ckpt_shard_count(ck), 2);
	assert_int_equal(tier_ckpt_find(ck, "lm_head.weight", &st, &t), 0);
	assert_non_null(strstr(tier_st_path(st), "00002"));
	float row[5];
	assert_int_equal(tier_st_read_range(st, t, 5 * 4, row, sizeof row), 0);
	assert_true(row[0] == 1005.0f && row[4] == 1009.0f);
	assert_int_equal(tier_ckpt_find(ck, "model.norm.weight", &st, &t), -ENOENT);
	assert_non_null(strstr(tier_last_error(), "model.norm.weight"));
	tier_ckpt_close(ck);

	/* A tensor mapped to the wrong shard, a missing shard, a path outside the directory. */
	write_text(idx, "{\"weight_map\": {\"lm_head.weight\": \"model-00001-of-00002.safetensors\"}}");
	assert_int_equal(tier_ckpt_open(path_in("sharded"), &ck), -EBADMSG);
	assert_null(ck);
	assert_non_null(strstr(tier_last_error(), "lm_head.weight"));
	assert_non_null(strstr(tier_last_error(), "does not contain"));
	write_text(idx, "{\"weight_map\": {\"lm_head.weight\": \"model-00003-of-00002.safetensors\"}}");
	assert_int_equal(tier_ckpt_open(path_in("sharded"), &ck), -ENOENT);
	assert_non_null(strstr(tier_last_error(), "model-00003-of-00002.safetensors"));
	write_text(idx, "{\"weight_map\": {\"lm_head.weight\": \"../rt.safetensors\"}}");
	assert_int_equal(tier_ckpt_open(path_in("sharded"), &ck), -EBADMSG);
	write_text(idx, "{\"weight_map\": [1]}");
	assert_int_equal(tier_ckpt_open(path_in("sharded"), &ck), -EBADMSG);
	write_text(idx, "{\"weight_map\": {\"lm_head.weight\": 3}}");
	assert_int_equal(tier_ckpt_open(path_in("sharded"), &ck), -EBADMSG);
	/* No index and no model.safetensors. */
	unlink(idx);
	assert_int_equal(tier_ckpt_open(path_in("sharded"), &ck), -ENOENT);
	assert_non_null(strstr(tier_last_error(), "model.safetensors"));
}

static void check_part(const tier_expert_part *p, uint64_t rows, uint64_t cols, const float *want)
{
	float *got = malloc(rows * cols * 4);
	assert_true(p->rows == rows && p->cols == cols && p->nbytes == rows * cols * 4);
	memset(got, 0xAA, rows * cols * 4);
	assert_int_equal(tier_st_read_range(p->st, p->t, p->off, got, p->nbytes), 0);
	assert_memory_equal(got, want, p->nbytes);
	free(got);
}

static void test_expert_layouts(void **state)
{
	enum { E = 3, I = 5, H = 4 };
	float gu[E][2 * I][H], dn[E][H][I];
	tier_expert_weights w;
	tier_ckpt *ck;
	(void)state;
	for (int e = 0; e < E; e++) {
		for (int r = 0; r < 2 * I; r++)
			for (int c = 0; c < H; c++)
				gu[e][r][c] = (float)(e * 100 + r * 10 + c);
		for (int r = 0; r < H; r++)
			for (int c = 0; c < I; c++)
				dn[e][r][c] = (float)(-e * 100 - r * 10 - c);
	}
	const char *names[3][3] = {
		{ "model.layers.1.mlp.experts.%d.gate_proj.weight", "model.layers.1.mlp.experts.%d.up_proj.weight",
		  "model.layers.1.mlp.experts.%d.down_proj.weight" },
		{ "model.layers.1.block_sparse_moe.experts.%d.w1.weight", "model.layers.1.block_sparse_moe.experts.%d.w3.weight",
		  "model.layers.1.block_sparse_moe.experts.%d.w2.weight" },
	};
	for (int layout = 0; layout < 3; layout++) {
		char sub[32], nm[3 * E][96];
		tier_st_wtensor t[3 * E];
		snprintf(sub, sizeof sub, "experts%d", layout);
		mkdir(path_in(sub), 0755);
		size_t n = 0;
		if (layout < 2) {
			for (int e = 0; e < E; e++)
				for (int k = 0; k < 3; k++) {
					snprintf(nm[n], sizeof nm[n], names[layout][k], e);
					t[n] = (tier_st_wtensor){ .name = nm[n], .dtype = TIER_DT_F32, .ndim = 2,
						.shape = { k == 2 ? H : I, k == 2 ? I : H },
						.data = k == 2 ? &dn[e][0][0] : &gu[e][k * I][0] };
					n++;
				}
		} else {
			t[n++] = (tier_st_wtensor){ .name = "model.layers.1.mlp.experts.gate_up_proj", .dtype = TIER_DT_F32,
				.ndim = 3, .shape = { E, 2 * I, H }, .data = gu };
			t[n++] = (tier_st_wtensor){ .name = "model.layers.1.mlp.experts.down_proj", .dtype = TIER_DT_F32,
				.ndim = 3, .shape = { E, H, I }, .data = dn };
		}
		snprintf(sub, sizeof sub, "experts%d/model.safetensors", layout);
		assert_int_equal(tier_st_write(path_in(sub), t, n, NULL), 0);
		snprintf(sub, sizeof sub, "experts%d", layout);
		assert_int_equal(tier_ckpt_open(path_in(sub), &ck), 0);
		for (int e = 0; e < E; e++) {
			memset(&w, 0x55, sizeof w);
			assert_int_equal(tier_ckpt_expert(ck, 1, e, &w), 0);
			assert_int_equal(w.layout, layout);
			check_part(&w.gate, I, H, &gu[e][0][0]);
			check_part(&w.up, I, H, &gu[e][I][0]);
			check_part(&w.down, H, I, &dn[e][0][0]);
		}
		assert_int_equal(tier_ckpt_expert(ck, 0, 0, &w), -ENOENT);
		assert_int_equal(tier_ckpt_expert(ck, 1, layout == 2 ? E : E + 7, &w), layout == 2 ? -EBADMSG : -ENOENT);
		tier_ckpt_close(ck);
	}
	/* A gate whose up is missing is reported, not silently skipped. */
	mkdir(path_in("experts-bad"), 0755);
	const char *one[] = { "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.0.down_proj.weight" };
	write_f32(path_in("experts-bad/model.safetensors"), one, 2, 2, 2);
	assert_int_equal(tier_ckpt_open(path_in("experts-bad"), &ck), 0);
	assert_int_equal(tier_ckpt_expert(ck, 0, 0, &w), -EBADMSG);
	assert_non_null(strstr(tier_last_error(), "up_proj"));
	tier_ckpt_close(ck);
}

/* ---- Atomic writes -------------------------------------------------------------------------- */

static int count_entries(const char *d)
{
	DIR *dd = opendir(d);
	struct dirent *e;
	int n = 0;
	while ((e = readdir(dd)))
		n += e->d_name[0] != '.';
	closedir(dd);
	return n;
}

static void test_atomic(void **state)
{
	tier_atomic_file *f;
	char buf[16] = { 0 };
	(void)state;
	mkdir(path_in("atomic"), 0755);
	char p[256];
	snprintf(p, sizeof p, "%s", path_in("atomic/ckpt.bin"));
	assert_int_equal(tier_atomic_write_begin(p, &f), 0);
	assert_int_equal(tier_atomic_write(f, "first", 5), 0);
	assert_int_equal(access(p, F_OK), -1);             /* not visible before commit */
	assert_int_equal(tier_atomic_write_commit(f), 0);
	assert_int_equal(tier_atomic_write_begin(p, &f), 0);
	assert_int_equal(tier_atomic_write(f, "second", 6), 0);
	tier_atomic_write_abort(f);                        /* the old file stays, the temporary goes */
	FILE *r = fopen(p, "r");
	assert_int_equal(fread(buf, 1, sizeof buf, r), 5);
	fclose(r);
	assert_string_equal(buf, "first");
	assert_int_equal(count_entries(path_in("atomic")), 1);
	f = (tier_atomic_file *)&f;
	assert_int_equal(tier_atomic_write_begin(path_in("nodir/x"), &f), -ENOENT);
	assert_null(f);
	tier_atomic_write_abort(NULL);
}

static void rm_tree(const char *d)
{
	DIR *dd = opendir(d);
	struct dirent *e;
	char p[512];
	struct stat sb;
	while (dd && (e = readdir(dd))) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		snprintf(p, sizeof p, "%s/%s", d, e->d_name);
		if (lstat(p, &sb) == 0 && S_ISDIR(sb.st_mode))
			rm_tree(p);
		else
			unlink(p);
	}
	if (dd)
		closedir(dd);
	rmdir(d);
}

int main(void)
{
	seed = test_seed("test_safetensors", 0);
#ifndef TIER_HAVE_JANSSON
	tier_st *st;
	int rc = tier_st_open("x.safetensors", &st);
	if (rc != -ENOTSUP || !strstr(tier_last_error(), "libjansson-dev"))
		return 1;
	printf("# built without jansson: safetensors says so; skipping the rest\n");
	return 77;
#endif
	snprintf(dir, sizeof dir, "st-test-XXXXXX");
	if (!mkdtemp(dir))
		return 1;
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_round_trip_every_dtype), cmocka_unit_test(test_read_and_convert),
		cmocka_unit_test(test_write_rejects), cmocka_unit_test(test_malformed),
		cmocka_unit_test(test_file_errors), cmocka_unit_test(test_sharded),
		cmocka_unit_test(test_expert_layouts), cmocka_unit_test(test_atomic),
	};
	int rc2 = cmocka_run_group_tests(tests, NULL, NULL);
	rm_tree(dir);
	return rc2;
}
