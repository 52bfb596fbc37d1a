/* data.c - training tokens: TIERTOK1 token files (docs/data.md), byte-level text, and sequences
 * sampled deterministically from (seed, index). */
#include "config.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "tier/model.h"

#define MAGIC "TIERTOK1"
#define HEADER 24
/* tier_data_sample hands tokens out as int32: a larger vocab would make some negative (fuzz_data) */
#define VOCAB_MAX 0x7fffffffu

/* The rule every vocabulary meets: 2..VOCAB_MAX, the separator below it. */
static int vocab_bad(uint32_t vocab, uint32_t sep) { return vocab < 2 || vocab > VOCAB_MAX || sep >= vocab; }

/* The vocabulary and separator in range, and every token below the vocabulary: the checks of
 * tokens handed in (tier_data_from_tokens, tier_data_write). */
static int tokens_check(const uint32_t *tokens, uint64_t count, uint32_t vocab, uint32_t sep)
{
	if (vocab_bad(vocab, sep))
		return tier_fail(-EINVAL, "vocab size %u must be in 2..%u and the separator %u below it", vocab, VOCAB_MAX,
				 sep);
	for (uint64_t i = 0; i < count; i++)
		if (tokens[i] >= vocab)
			return tier_fail(-EINVAL, "token %llu is %u, not below the vocab size %u", (unsigned long long)i,
					 tokens[i], vocab);
	return 0;
}

struct tier_data {
	uint32_t *tok;
	uint64_t n;
	uint32_t vocab, sep;
};

static uint32_t rd32(const unsigned char *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }
static uint64_t rd64(const unsigned char *p) { return rd32(p) | (uint64_t)rd32(p + 4) << 32; }
static void wr32(unsigned char *p, uint32_t v) { for (int i = 0; i < 4; i++) p[i] = (unsigned char)(v >> 8 * i); }

static int read_all(const char *path, unsigned char **buf, size_t *len)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return tier_fail(-errno, "%s: cannot open: %s", path, strerror(errno));
	unsigned char *b = NULL;
	size_t n = 0, cap = 0;
	for (;;) {
		if (n == cap) {
			unsigned char *nb = realloc(b, cap = cap ? 2 * cap : 65536);
			if (!nb) {
				free(b);
				fclose(f);
				return tier_fail(-ENOMEM, "%s: out of memory reading it", path);
			}
			b = nb;
		}
		size_t r = fread(b + n, 1, cap - n, f);
		n += r;
		if (r == 0)
			break;
	}
	int err = ferror(f);
	fclose(f);
	if (err) {
		free(b);
		return tier_fail(-EIO, "%s: read error", path);
	}
	*buf = b, *len = n;
	return 0;
}

static int parse_tokens(const char *path, const unsigned char *b, size_t len, tier_data *d)
{
	if (len < HEADER)
		return tier_fail(-EBADMSG, "%s: token file header truncated (%zu of %d bytes)", path, len, HEADER);
	d->vocab = rd32(b + 8), d->sep = rd32(b + 12), d->n = rd64(b + 16);
	if (vocab_bad(d->vocab, d->sep))
		return tier_fail(-EBADMSG, "%s: vocab size %u must be in 2..%u and the separator %u below it", path,
				 d->vocab, VOCAB_MAX, d->sep);
	if (d->n > (len - HEADER) / 4 || (len - HEADER) % 4 || d->n != (len - HEADER) / 4)
		return tier_fail(-EBADMSG, "%s: header says %llu tokens, the file holds %zu bytes of tokens", path,
				 (unsigned long long)d->n, len - HEADER);
	if (!(d->tok = malloc(sizeof(uint32_t) * (d->n ? d->n : 1))))
		return tier_fail(-ENOMEM, "%s: out of memory for %llu tokens", path, (unsigned long long)d->n);
	for (uint64_t i = 0; i < d->n; i++) {
		d->tok[i] = rd32(b + HEADER + 4 * i);
		if (d->tok[i] >= d->vocab)
			return tier_fail(-EBADMSG, "%s: token %llu is %u, not below the vocab size %u", path,
					 (unsigned long long)i, d->tok[i], d->vocab);
	}
	return 0;
}

/* Bytes are tokens; an empty line (two or more newlines) ends a document: TIER_TOK_SEP. */
static int parse_text(const char *path, const unsigned char *b, size_t len, tier_data *d)
{
	d->vocab = TIER_BYTE_VOCAB, d->sep = TIER_TOK_SEP, d->n = 0;
	if (!(d->tok = malloc(sizeof(uint32_t) * (len + 1))))
		return tier_fail(-ENOMEM, "%s: out of memory for %zu tokens", path, len);
	for (size_t i = 0; i < len;) {
		if (b[i] == '\n' && i + 1 < len && b[i + 1] == '\n') {
			while (i < len && b[i] == '\n')
				i++;
			if (d->n && i < len)
				d->tok[d->n++] = TIER_TOK_SEP;
			continue;
		}
		d->tok[d->n++] = b[i++];
	}
	return 0;
}

int tier_data_open(const char *path, tier_data **out)
{
	if (!out || !path)
		return tier_fail(-EINVAL, "tier_data_open: path and out are required");
	*out = NULL;
	unsigned char *b = NULL;
	size_t len = 0;
	int rc = read_all(path, &b, &len);
	if (rc)
		return rc;
	tier_data *d = calloc(1, sizeof *d);
	if (!d) {
		free(b);
		return tier_fail(-ENOMEM, "out of memory");
	}
	if (len >= 8 && !memcmp(b, MAGIC, 8))
		rc = parse_tokens(path, b, len, d);
	else
		rc = parse_text(path, b, len, d);
	free(b);
	if (rc) {
		tier_data_close(d);
		return rc;
	}
	*out = d;
	return 0;
}

int tier_data_from_tokens(const uint32_t *tokens, uint64_t count, uint32_t vocab, uint32_t sep, tier_data **out)
{
	if (!out || (!tokens && count))
		return tier_fail(-EINVAL, "tier_data_from_tokens: tokens and out are required");
	*out = NULL;
	int rc = tokens_check(tokens, count, vocab, sep);
	if (rc)
		return rc;
	tier_data *d = calloc(1, sizeof *d);
	if (!d || !(d->tok = malloc(sizeof(uint32_t) * (count ? count : 1)))) {
		free(d);
		return tier_fail(-ENOMEM, "out of memory for %llu tokens", (unsigned long long)count);
	}
	if (count)
		memcpy(d->tok, tokens, sizeof(uint32_t) * count);
	d->n = count, d->vocab = vocab, d->sep = sep;
	*out = d;
	return 0;
}

void tier_data_close(tier_data *d)
{
	if (d)
		free(d->tok);
	free(d);
}

uint64_t tier_data_count(const tier_data *d) { return d->n; }
uint32_t tier_data_vocab(const tier_data *d) { return d->vocab; }

int tier_data_write(const char *path, const uint32_t *tokens, uint64_t count, uint32_t vocab, uint32_t sep)
{
	if (!path || (!tokens && count))
		return tier_fail(-EINVAL, "tier_data_write: path and tokens are required");
	int rc = tokens_check(tokens, count, vocab, sep);
	if (rc)
		return rc;
	unsigned char h[HEADER], buf[4096];
	memcpy(h, MAGIC, 8);
	wr32(h + 8, vocab), wr32(h + 12, sep), wr32(h + 16, (uint32_t)count), wr32(h + 20, (uint32_t)(count >> 32));
	tier_atomic_file *f;
	if ((rc = tier_atomic_write_begin(path, &f)))
		return rc;
	rc = tier_atomic_write(f, h, HEADER);
	for (uint64_t i = 0; i < count && !rc; i += sizeof buf / 4) {
		size_t n = count - i < sizeof buf / 4 ? (size_t)(count - i) : sizeof buf / 4;
		for (size_t j = 0; j < n; j++)
			wr32(buf + 4 * j, tokens[i + j]);
		rc = tier_atomic_write(f, buf, 4 * n);
	}
	if (rc) {
		tier_atomic_write_abort(f);
		return rc;
	}
	return tier_atomic_write_commit(f);
}

int tier_data_sample(const tier_data *d, uint64_t seed, uint64_t index, int seq, int32_t *tokens, int32_t *labels)
{
	if (!d || !tokens || !labels || seq < 1)
		return tier_fail(-EINVAL, "tier_data_sample: data, outputs and seq >= 1 are required");
	if (d->n < (uint64_t)seq + 1)
		return tier_fail(-EINVAL, "the data holds %llu tokens, shorter than one sequence of %d plus its last "
				 "label; use more data or a shorter --seq", (unsigned long long)d->n, seq);
	tier_rng r;
	tier_rng_seed(&r, seed * 0x9e3779b97f4a7c15ull ^ (index + 1) * 0xbf58476d1ce4e5b9ull);
	uint64_t start = tier_rng_below(&r, d->n - (uint64_t)seq);
	for (int i = 0; i < seq; i++) {
		tokens[i] = (int32_t)d->tok[start + i];
		labels[i] = (int32_t)d->tok[start + i + 1];
	}
	return 0;
}
