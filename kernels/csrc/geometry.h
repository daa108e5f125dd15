/* A run's geometry (groups, chunks, protected tokens, section sizes) and aliasing-safe views of pool rows.
 * Part of lynx_codec.c's single translation unit (included there, in order). */
/* ---- run geometry ---- */

typedef struct {
    const lynx_params *p;
    int64_t n, hd, stride;
    int H, D, g, a, r, vb, wbits, over, rotate, exact;
    int wide16;  /* 512-bit vectors: row_minmax (row_minmax8 otherwise) */
    int64_t kept_end;  /* tokens [sink, kept_end) are not protected */
} geo_t;

static void geo_init(geo_t *G, const lynx_params *p) {
    G->p = p;
    G->n = p->total_tokens;
    G->H = p->heads;
    G->D = p->head_dim;
    G->hd = (int64_t)p->heads * p->head_dim;
    G->stride = p->pool_stride;
    G->g = p->group_size;
    G->a = p->anchor_bits;
    G->r = 8 - p->anchor_bits;
    G->vb = p->dtype == DT_F32 ? 4 : 2;
    G->wbits = 8 * G->vb;
    G->over = p->over_tokens;
    G->rotate = p->rotate;
    G->exact = p->exact;
#if defined(__x86_64__)
    G->wide16 = __builtin_cpu_supports("avx512f");
#else
    G->wide16 = 0;
#endif
    G->kept_end = G->n - p->recent;
}

INLINE int is_protected(const geo_t *G, int64_t t) { return t < G->p->sink || t >= G->kept_end; }

static int64_t protected_count(const geo_t *G, int64_t s, int64_t e) {
    int64_t sink = G->p->sink;
    int64_t sinks = (e < sink ? e : sink) - s;
    int64_t lo = G->kept_end > sink ? G->kept_end : sink;
    if (lo < s) lo = s;
    int64_t recents = e - lo;
    return (sinks > 0 ? sinks : 0) + (recents > 0 ? recents : 0);
}

/* First and end of the unprotected tokens of [s, e) (one range: protected tokens are a prefix and
 * a suffix of the run). */
static void kept_range(const geo_t *G, int64_t s, int64_t e, int64_t *k0, int64_t *k1) {
    int64_t a = s > G->p->sink ? s : G->p->sink;
    int64_t b = e < G->kept_end ? e : G->kept_end;
    *k0 = a;
    *k1 = b > a ? b : a;
}

static int64_t group_count(const geo_t *G, int64_t nc) {
    return G->over ? (nc + G->g - 1) / G->g * G->hd : nc * G->hd / G->g;
}
static int64_t anchor_payload_len(const geo_t *G, int64_t s, int64_t e) {
    int64_t nc = e - s;
    return nc * G->hd * G->a / 8 + 4 * group_count(G, nc) + protected_count(G, s, e) * G->hd * G->vb;
}
static int64_t low_len(const geo_t *G, int64_t nc) { return nc * G->hd * G->r / 8; }
static int64_t residual_bound(const geo_t *G, int64_t nc) {
    return G->exact ? nc * G->hd * G->vb : low_len(G, nc);
}
static int64_t num_blocks(int64_t nv) { return (nv + BLOCK - 1) / BLOCK; }

INLINE const uint8_t *pool_row(const geo_t *G, const uint8_t *pool, int64_t slot) {
    return pool + slot * G->stride * G->vb;
}

/* How many rows ahead of the one it works on a run prefetches its pool rows: a pool is far larger
 * than the caches, and without it each row's first loads (or, applying, its stores' line fills)
 * waited on memory — 30 % of an int8 encode's samples sat on the row's first load. Measured
 * on 2026-12-04 (one core, Llama-3.1-8B layer, 8192 rows; 1, 2, 4, 8 tried): encode +10-15 %
 * at 2; Anchor and Residual apply +12-15 % at 4 with the other core busy, within the noise on an
 * idle box. */
#define PREFETCH_READ_AHEAD 2
#define PREFETCH_WRITE_AHEAD 4

/* Every cache line of a pool row, for reading (write 0) or writing (1). */
INLINE void prefetch_row(const uint8_t *row, int64_t nbytes, const int write) {
    for (int64_t off = 0; off < nbytes; off += 64) {
        if (write)
            __builtin_prefetch(row + off, 1, 3);
        else
            __builtin_prefetch(row + off, 0, 3);
    }
}

static void put_header(uint8_t *h, const geo_t *G, int stream, int flags, int64_t start, int64_t end,
                       int64_t payload_len) {
    const lynx_params *p = G->p;
    memcpy(h, "LYNX", 4);
    h[4] = FORMAT_VERSION;
    h[5] = (uint8_t)stream;
    h[6] = (uint8_t)p->kind;
    h[7] = (uint8_t)p->dtype;
    h[8] = (uint8_t)flags;
    h[9] = (uint8_t)p->anchor_bits;
    put16(h + 10, (uint16_t)p->group_size);
    put16(h + 12, (uint16_t)p->layer);
    put16(h + 14, (uint16_t)p->heads);
    put16(h + 16, (uint16_t)p->head_dim);
    put16(h + 18, (uint16_t)p->sink);
    put16(h + 20, (uint16_t)p->recent);
    put32(h + 22, p->seed);
    put64(h + 26, p->request_tag);
    put32(h + 34, (uint32_t)p->total_tokens);
    put32(h + 38, (uint32_t)start);
    put32(h + 42, (uint32_t)end);
    put32(h + 46, (uint32_t)payload_len);
    put32(h + 50, 0);
    put32(h + 50, crc32_update(0, h, HEADER_SIZE + payload_len));
}

/* ---- vectors, and aliasing-safe views of pool rows and scratch ---- */

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t u16a __attribute__((may_alias, aligned(1)));

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));

INLINE v8f vload(const float *p) { v8f v; memcpy(&v, p, 32); return v; }
INLINE void vstore(float *p, v8f v) { memcpy(p, &v, 32); }
INLINE v16f vload16(const float *p) { v16f v; memcpy(&v, p, 64); return v; }
INLINE void vstore16(float *p, v16f v) { memcpy(p, &v, 64); }
