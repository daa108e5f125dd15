/* Shared definitions: return codes, wire constants, the run parameters (mirrors ops_cpu._Params), errors, aligned scratch.
 * Part of lynx_codec.c's single translation unit (included there, in order). */
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
/* AVX-512 (v4), AVX2 (v3) and baseline clones of each hot function, chosen at load time. v4 over
 * v3 on an AVX-512 Xeon, alternated in one run (docs/codec.md): int8 encode +8-15 %, exact
 * encode +5-13 %, exact Residual apply +15-20 %. */
#define LYNX_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LYNX_CLONES
#endif
#define INLINE static inline __attribute__((always_inline))

/* Return codes (kept in sync with ops_cpu). */
enum { LYNX_OK = 0, LYNX_E_INPUT = 1, LYNX_E_CHUNK = 2, LYNX_E_BUFFER = 3, LYNX_E_NOMEM = 4,
       LYNX_E_ARG = 5 };
enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum { STREAM_ANCHOR = 0, STREAM_RESIDUAL = 1 };
#define FLAG_EXACT 1
#define FLAG_RAW 8
#define HEADER_SIZE 54
#define FORMAT_VERSION 2
#define FP16_MAX 65504.0f
#define BLOCK 256
#define ESCAPE_Q 16
#define NCLS 16
#define BITLEN_BINS 40
#define HIST_STRIDE 7

/* Mirrors ops_cpu._Params field for field. */
typedef struct {
    int32_t dtype;        /* wire code: 0 fp32, 1 fp16, 2 bf16 */
    int32_t kind;         /* wire code: 0 K, 1 V */
    int32_t exact;        /* target exact */
    int32_t over_tokens;  /* groups span tokens (K per channel) */
    int32_t rotate;
    int32_t flags;        /* the header flags of the spec (exact, rotate, K per token) */
    int32_t anchor_bits;
    int32_t group_size;
    int32_t heads;
    int32_t head_dim;
    int32_t sink;
    int32_t recent;
    uint32_t seed;
    int32_t layer;
    uint64_t request_tag;
    int64_t total_tokens;
    int64_t chunk_tokens; /* encode only */
    int64_t pool_rows;
    int64_t pool_stride;  /* elements from one pool row to the next */
    float inv_sqrt_d;     /* fp32(1/sqrt(head_dim)) */
    float limit;          /* exact: |x| >= limit is zeroed for the statistics */
    int32_t class_offset;
    int32_t k_base;
    const float *signs;   /* head_dim values of +-1 */
} lynx_params;

typedef struct {
    char *buf;
    int64_t len;
} err_t;

static int fail(err_t *e, int code, const char *fmt, ...) {
    if (e->buf && e->len > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(e->buf, (size_t)e->len, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* ---- scratch: per-thread blocks kept between calls ----
 * A call's scratch (up to a few MiB) is kept by its thread for the next call instead of freed:
 * glibc hands blocks this large back to the kernel on free, and faulting fresh zeroed pages in
 * on every call showed as 6-13 % of an int8 encode's profile (clear_page_erms under _int_malloc);
 * kept, an int8 encode of 1500 tokens of Llama-3.1-8B's K took 2.1 ms instead of 2.7 (medians of
 * three runs, one core). At most SCRATCH_SLOTS blocks of at most SCRATCH_KEEP bytes each stay with a
 * thread; they are freed when it exits. A block starts with its capacity, SCRATCH_HEAD bytes
 * before the 64-byte aligned pointer the caller gets. */
#define SCRATCH_SLOTS 16
#define SCRATCH_KEEP ((size_t)16 << 20)
#define SCRATCH_HEAD 64

typedef struct {
    uint8_t *blk[SCRATCH_SLOTS];
    int n;
} scratch_cache_t;

static __thread scratch_cache_t tls_scratch;
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_exit(void *arg) {
    scratch_cache_t *c = arg;
    for (int i = 0; i < c->n; i++) free(c->blk[i]);
    c->n = 0;
}

static void scratch_key_init(void) { pthread_key_create(&scratch_key, scratch_exit); }

INLINE size_t scratch_cap(const uint8_t *b) {
    size_t cap;
    memcpy(&cap, b, sizeof cap);
    return cap;
}

/* 64-byte aligned scratch of n bytes (the smallest kept block that holds it, else a new one);
 * give it back with xfree. */
static void *xalloc(int64_t n) {
    const size_t size = (size_t)((n + 127) / 64 * 64);
    scratch_cache_t *c = &tls_scratch;
    int best = -1;
    for (int i = 0; i < c->n; i++)
        if (scratch_cap(c->blk[i]) >= size && (best < 0 || scratch_cap(c->blk[i]) < scratch_cap(c->blk[best])))
            best = i;
    uint8_t *b;
    if (best >= 0) {
        b = c->blk[best];
        c->blk[best] = c->blk[--c->n];
    } else {
        b = aligned_alloc(64, size + SCRATCH_HEAD);
        if (!b) return NULL;
        memcpy(b, &size, sizeof size);
    }
    return b + SCRATCH_HEAD;
}

static void xfree(void *p) {
    if (!p) return;
    uint8_t *b = (uint8_t *)p - SCRATCH_HEAD;
    scratch_cache_t *c = &tls_scratch;
    if (scratch_cap(b) > SCRATCH_KEEP || c->n == SCRATCH_SLOTS) {
        free(b);
        return;
    }
    if (c->n == 0) { /* the thread's exit frees what it keeps (the key needs a non-NULL value) */
        pthread_once(&scratch_once, scratch_key_init);
        pthread_setspecific(scratch_key, c);
    }
    c->blk[c->n++] = b;
}
