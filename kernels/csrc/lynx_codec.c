/* The fused per-(layer, kind) codec runs in plain C (C11 + GCC extensions, no Python/torch headers).
 *
 * Owns the CPU implementation of lynx_kernels.fused: encode a run of KV pool rows into Anchor and
 * Residual wire chunks (header, payload, CRC-32), and apply landed chunks back into pool rows.
 * Called by lynx_kernels.ops_cpu through ctypes. It must be bit-identical to the torch reference
 * (lynx_kernels.codec, .wire, .exact, .rotation): every float step is the reference's IEEE fp32
 * operation in the reference's order; the build passes -ffp-contract=off and no fast-math, so the
 * compiler neither fuses a multiply-add nor reassociates a sum. Hot functions are compiled twice
 * (x86-64-v3 and baseline, chosen at load time) via target_clones.
 *
 * Assumes a little-endian host (the wire format is little endian and is read/written with memcpy).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define LYNX_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
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

static void *xalloc(int64_t n) {
    size_t size = (size_t)((n + 127) / 64 * 64);
    return aligned_alloc(64, size);
}

/* ---- scalar conversions (round to nearest even, as torch) ---- */

INLINE uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
INLINE float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* Branch-free select (the compiler vectorizes loops of these; it does not if-convert every ?:). */
INLINE uint32_t select_u32(uint32_t cond, uint32_t a, uint32_t b) {
    const uint32_t m = 0u - (cond != 0);
    return (a & m) | (b & ~m);
}

INLINE float select_f32(uint32_t cond, float a, float b) {
    return bits_f32(select_u32(cond, f32_bits(a), f32_bits(b)));
}

/* fp16 <-> fp32 in integer steps the compiler vectorizes (GCC 12 cannot vectorize _Float16):
 * F. Giesen's exact conversions; fp32 -> fp16 rounds to nearest even like torch and F16C
 * (checked against F16C for every fp32 and fp16 value). */
INLINE float h2f(uint32_t h) {
    uint32_t u = (h & 0x7FFFu) << 13;
    const uint32_t exp = u & (0x7C00u << 13);
    u += (127u - 15u) << 23;
    u = select_u32(exp == (0x7C00u << 13), u + ((128u - 16u) << 23), u);
    /* zero / subnormal: renormalize by an exact float subtraction */
    const uint32_t sub = f32_bits(bits_f32(u + (1u << 23)) - bits_f32(113u << 23));
    return bits_f32(select_u32(exp == 0, sub, u) | ((h & 0x8000u) << 16));
}
INLINE uint32_t f2h(float x) {
    uint32_t u = f32_bits(x);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    const float denorm_magic = bits_f32(((127u - 15u) + (23u - 10u) + 1u) << 23);
    const uint32_t sub = f32_bits(bits_f32(u) + denorm_magic) - f32_bits(denorm_magic);
    const uint32_t norm = (u + ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((u >> 13) & 1u)) >> 13;
    const uint32_t big = select_u32(u > 0x7F800000u, 0x7E00u, 0x7C00u);
    return select_u32(u >= (143u << 23), big, select_u32(u < (113u << 23), sub, norm)) | (sign >> 16);
}
/* Predictions are finite (never NaN), so torch's NaN branch is not needed. */
INLINE uint32_t f2b(float x) {
    const uint32_t u = f32_bits(x);
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
INLINE uint32_t h_down(uint32_t h) {  /* fp16 nextafter toward -inf */
    return select_u32((h & 0x7FFF) == 0, 0x8001u, h + ((h >> 15) << 1) - 1);
}
INLINE uint32_t h_up(uint32_t h) {    /* fp16 nextafter toward +inf */
    return select_u32((h & 0x7FFF) == 0, 0x0001u, h + 1 - ((h >> 15) << 1));
}

INLINE uint16_t get16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
INLINE uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
INLINE uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
INLINE void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
INLINE void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
INLINE void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* ---- CRC-32 (zlib's): slicing-by-8 tables, PCLMUL folding where the CPU has it ---- */

static uint32_t crc_table[8][256];
static int have_clmul;

static void crc_init(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (int i = 0; i < 256; i++)
            crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
}

/* State in, state out (the state is the complemented CRC). */
static uint32_t crc_tables(uint32_t c, const uint8_t *p, int64_t n) {
    while (n >= 8) {
        uint64_t w = get64(p) ^ c;
        c = crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^ crc_table[5][(w >> 16) & 0xFF] ^
            crc_table[4][(w >> 24) & 0xFF] ^ crc_table[3][(w >> 32) & 0xFF] ^
            crc_table[2][(w >> 40) & 0xFF] ^ crc_table[1][(w >> 48) & 0xFF] ^ crc_table[0][w >> 56];
        p += 8;
        n -= 8;
    }
    while (n--) c = crc_table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__)
/* Carry-less multiplication folding (Gopal et al., "Fast CRC Computation for Generic Polynomials
 * Using PCLMULQDQ", 2009) with the bit-reflected constants of the zlib polynomial. n >= 64 and a
 * multiple of 16; state in, state out. */
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc_clmul(uint32_t c, const uint8_t *p, int64_t n) {
    const __m128i k1k2 = _mm_set_epi64x(0x1c6e41596LL, 0x154442bd4LL);
    const __m128i k3k4 = _mm_set_epi64x(0x0ccaa009eLL, 0x1751997d0LL);
    const __m128i k5 = _mm_set_epi64x(0, 0x163cd6124LL);
    const __m128i poly = _mm_set_epi64x(0x1f7011641LL, 0x1db710641LL);
    const __m128i low32 = _mm_setr_epi32(-1, 0, -1, 0);
    __m128i x1 = _mm_loadu_si128((const __m128i *)p), x2 = _mm_loadu_si128((const __m128i *)(p + 16));
    __m128i x3 = _mm_loadu_si128((const __m128i *)(p + 32)), x4 = _mm_loadu_si128((const __m128i *)(p + 48));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)c));
    p += 64;
    n -= 64;
    while (n >= 64) {
        __m128i h1 = _mm_clmulepi64_si128(x1, k1k2, 0x11), h2 = _mm_clmulepi64_si128(x2, k1k2, 0x11);
        __m128i h3 = _mm_clmulepi64_si128(x3, k1k2, 0x11), h4 = _mm_clmulepi64_si128(x4, k1k2, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k1k2, 0x00), h1),
                           _mm_loadu_si128((const __m128i *)p));
        x2 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x2, k1k2, 0x00), h2),
                           _mm_loadu_si128((const __m128i *)(p + 16)));
        x3 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x3, k1k2, 0x00), h3),
                           _mm_loadu_si128((const __m128i *)(p + 32)));
        x4 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x4, k1k2, 0x00), h4),
                           _mm_loadu_si128((const __m128i *)(p + 48)));
        p += 64;
        n -= 64;
    }
    /* Fold the four lanes into one, then the remaining 16-byte blocks. */
    __m128i rest[3] = {x2, x3, x4};
    for (int i = 0; i < 3; i++)
        x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x00),
                                         _mm_clmulepi64_si128(x1, k3k4, 0x11)), rest[i]);
    while (n >= 16) {
        x1 = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(x1, k3k4, 0x00),
                                         _mm_clmulepi64_si128(x1, k3k4, 0x11)),
                           _mm_loadu_si128((const __m128i *)p));
        p += 16;
        n -= 16;
    }
    /* 128 -> 64 -> 32 bits, then Barrett reduction. */
    x2 = _mm_clmulepi64_si128(x1, k3k4, 0x10);
    x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, low32), k5, 0x00), x2);
    x2 = _mm_clmulepi64_si128(_mm_and_si128(x1, low32), poly, 0x10);
    x2 = _mm_clmulepi64_si128(_mm_and_si128(x2, low32), poly, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}
#endif

static uint32_t crc32_update(uint32_t crc, const uint8_t *p, int64_t n) {
    uint32_t c = ~crc;
#if defined(__x86_64__)
    if (have_clmul && n >= 64) {
        int64_t m = n & ~(int64_t)15;
        c = crc_clmul(c, p, m);
        p += m;
        n -= m;
    }
#endif
    return ~crc_tables(c, p, n);
}

/* ---- run geometry ---- */

typedef struct {
    const lynx_params *p;
    int64_t n, hd, stride;
    int H, D, g, a, r, vb, wbits, over, rotate, exact;
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

INLINE v8f vload(const float *p) { v8f v; memcpy(&v, p, 32); return v; }
INLINE void vstore(float *p, v8f v) { memcpy(p, &v, 32); }

/* ---- rotation: FWHT with the reference's butterfly order (lynx_kernels.rotation) ---- */

/* Strides 1, 2, 4 inside 8 values: lane j gets partner + (+-1) * x[j]; for the lower index of a
 * pair that is b + a (= a + b), for the upper a + (-b) (= a - b), both exact IEEE equivalents. */
INLINE v8f fwht8(v8f x) {
    const v8f s1 = {1, -1, 1, -1, 1, -1, 1, -1}, s2 = {1, 1, -1, -1, 1, 1, -1, -1};
    const v8f s4 = {1, 1, 1, 1, -1, -1, -1, -1};
    x = __builtin_shuffle(x, (v8i){1, 0, 3, 2, 5, 4, 7, 6}) + x * s1;
    x = __builtin_shuffle(x, (v8i){2, 3, 0, 1, 6, 7, 4, 5}) + x * s2;
    return __builtin_shuffle(x, (v8i){4, 5, 6, 7, 0, 1, 2, 3}) + x * s4;
}

/* One head of D = 8 * nv values, in registers: rotate (FWHT(y * signs) * inv) or unrotate
 * (FWHT(y) * signs * inv). */
INLINE void head_regs(float *y, const float *sg, float inv, const int nv, const int unrot) {
    v8f r[16];
#pragma GCC unroll 16
    for (int i = 0; i < nv; i++) r[i] = unrot ? vload(y + 8 * i) : vload(y + 8 * i) * vload(sg + 8 * i);
#pragma GCC unroll 16
    for (int i = 0; i < nv; i++) r[i] = fwht8(r[i]);
#pragma GCC unroll 4
    for (int h = 1; h < nv; h <<= 1)
#pragma GCC unroll 8
        for (int p = 0; p < nv / 2; p++) { /* the p-th pair (j, j + h) of this stride */
            const int j = p / h * 2 * h + p % h;
            const v8f a = r[j], b = r[j + h];
            r[j] = a + b;
            r[j + h] = a - b;
        }
#pragma GCC unroll 16
    for (int i = 0; i < nv; i++) vstore(y + 8 * i, (unrot ? r[i] * vload(sg + 8 * i) : r[i]) * inv);
}

/* Heads wider than 128 values: the same butterflies through memory. */
INLINE void head_mem(float *y, const float *sg, float inv, int d, int unrot) {
    if (!unrot)
        for (int j = 0; j < d; j++) y[j] *= sg[j];
    for (int i = 0; i < d; i += 8) vstore(y + i, fwht8(vload(y + i)));
    for (int h = 8; h < d; h <<= 1)
        for (int i = 0; i < d; i += 2 * h)
            for (int j = i; j < i + h; j += 8) {
                const v8f a = vload(y + j), b = vload(y + j + h);
                vstore(y + j, a + b);
                vstore(y + j + h, a - b);
            }
    if (unrot)
        for (int j = 0; j < d; j++) y[j] *= sg[j];
    for (int j = 0; j < d; j++) y[j] *= inv;
}

INLINE void row_transform(const geo_t *G, float *x, const int unrot) {
    const float *sg = G->p->signs;
    const float inv = G->p->inv_sqrt_d;
    for (int h = 0; h < G->H; h++) {
        float *y = x + (int64_t)h * G->D;
        switch (G->D) {
            case 128: head_regs(y, sg, inv, 16, unrot); break;
            case 64: head_regs(y, sg, inv, 8, unrot); break;
            case 32: head_regs(y, sg, inv, 4, unrot); break;
            case 16: head_regs(y, sg, inv, 2, unrot); break;
            case 8: head_regs(y, sg, inv, 1, unrot); break;
            default: head_mem(y, sg, inv, G->D, unrot);
        }
    }
}

/* ---- bit packing (lynx_kernels.ops_torch.pack_bits' layout) ---- */

/* A row of codes into its top `a` bits and low 8 - a bits, each packed. */
INLINE void pack_codes(const uint8_t *c, int64_t n, int a, uint8_t *top, uint8_t *low) {
    const int r = 8 - a;
    if (a == 4) {
        for (int64_t i = 0; i < n / 2; i++) {
            const uint32_t w = ((const u16a *)c)[i];
            top[i] = (uint8_t)(((w >> 4) & 0x0F) | ((w >> 8) & 0xF0));
            low[i] = (uint8_t)((w & 0x0F) | ((w >> 4) & 0xF0));
        }
        return;
    }
    for (int64_t k = 0; k < n / 8; k++) {
        const uint64_t w = get64(c + 8 * k);
        uint64_t t = 0, l = 0;
        for (int j = 0; j < 8; j++) {
            const uint64_t cj = (w >> (8 * j)) & 0xFF;
            t |= (cj >> r) << (a * j);
            l |= (cj & ((1u << r) - 1)) << (r * j);
        }
        memcpy(top + k * a, &t, (size_t)a);
        memcpy(low + k * r, &l, (size_t)r);
    }
}

/* Packed top bits (and low bits, or none: then the codes' low bits are 0) into a row of codes. */
INLINE void unpack_codes(const uint8_t *top, const uint8_t *low, int64_t n, int a, uint8_t *c) {
    const int r = 8 - a;
    if (a == 4) {
        if (low) {
            for (int64_t i = 0; i < n / 2; i++) {
                const uint32_t t = top[i], l = low[i];
                ((u16a *)c)[i] = (uint16_t)(((t & 0x0F) << 4) | (l & 0x0F) | (((t & 0xF0) | (l >> 4)) << 8));
            }
        } else {
            for (int64_t i = 0; i < n / 2; i++) {
                const uint32_t t = top[i];
                ((u16a *)c)[i] = (uint16_t)(((t & 0x0F) << 4) | ((t & 0xF0) << 8));
            }
        }
        return;
    }
    const uint64_t amask = (1u << a) - 1, rmask = (1u << r) - 1;
    for (int64_t k = 0; k < n / 8; k++) {
        uint64_t t = 0, l = 0, w = 0;
        memcpy(&t, top + k * a, (size_t)a);
        if (low) memcpy(&l, low + k * r, (size_t)r);
        for (int j = 0; j < 8; j++)
            w |= ((((t >> (a * j)) & amask) << r) | ((l >> (r * j)) & rmask)) << (8 * j);
        memcpy(c + 8 * k, &w, 8);
    }
}

/* ---- quantization (lynx_kernels.codec._group_stats, ops_torch.quantize_codes) ---- */

/* Per-group parameters, structure of arrays: fp16 bits of zero and scale, and as fp32 (with the
 * inverse scale for quantizing). */
typedef struct {
    uint16_t *zb, *sb;
    float *z, *s, *inv;
} groups_t;

INLINE float clamp16(float v) {
    v = select_f32(v > -FP16_MAX, v, -FP16_MAX);
    return select_f32(v < FP16_MAX, v, FP16_MAX);
}

/* fp16 zero (the minimum rounded down) and scale ((max - zero) / 255 rounded up) of n groups. */
INLINE int group_params(const float *restrict lo, const float *restrict hi, int64_t n, groups_t *q,
                        int64_t at) {
    int clamped = 0;
    uint16_t *restrict zbs = q->zb + at, *restrict sbs = q->sb + at;
    float *restrict zs = q->z + at, *restrict ss = q->s + at, *restrict invs = q->inv + at;
    for (int64_t i = 0; i < n; i++) {
        clamped |= !(lo[i] >= -FP16_MAX) | !(hi[i] <= FP16_MAX);
        const float l = clamp16(lo[i]) + 0.0f, h = clamp16(hi[i]) + 0.0f; /* -0 -> +0 */
        uint32_t zb = f2h(l);
        zb = select_u32(h2f(zb) > l, h_down(zb), zb);
        const float z = h2f(zb), span = h - z;
        uint32_t sb = f2h(span / 255.0f);
        sb = select_u32(h2f(sb) * 255.0f < span, h_up(sb), sb);
        const float s = h2f(sb);
        zbs[i] = (uint16_t)zb;
        sbs[i] = (uint16_t)sb;
        zs[i] = z;
        ss[i] = s;
        invs[i] = select_f32(s > 0.0f, 1.0f / select_f32(s > 0.0f, s, 1.0f), 0.0f); /* no division by 0 */
    }
    return clamped;
}

INLINE void groups_from_bits(const uint8_t *zero, const uint8_t *scale, int64_t n, groups_t *q) {
    uint16_t *restrict zbs = q->zb, *restrict sbs = q->sb;
    float *restrict zs = q->z, *restrict ss = q->s;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t zb = get16(zero + 2 * i), sb = get16(scale + 2 * i);
        zbs[i] = zb;
        sbs[i] = sb;
        zs[i] = h2f(zb);
        ss[i] = h2f(sb);
    }
}

INLINE uint8_t quantize(float x, float z, float inv) {
    float t = (x - z) * inv + 0.5f;
    t = t > 0.0f ? t : 0.0f;
    t = t < 255.0f ? t : 255.0f;
    return (uint8_t)(int32_t)t;
}

/* quantize() for a value inside its group's statistics: then x - zero >= 0 and
 * (x - zero) * fp32(1/scale) <= 255 * (1 + 2^-24)^2, so t lies in [0.5, 256) and the clamp is
 * a no-op (same code, fewer instructions). */
INLINE uint8_t quantize_in_range(float x, float z, float inv) {
    return (uint8_t)(int32_t)((x - z) * inv + 0.5f);
}

/* A row's codes; `at` is the row's first group. `inside`: every value lies within its groups'
 * (unclamped) statistics, so quantize_in_range applies. */
INLINE void quantize_row(const geo_t *G, const float *restrict x, const groups_t *q, int64_t at,
                         uint8_t *restrict c, int inside) {
    const int64_t hd = G->hd, g = G->g;
    if (G->over) {
        const float *restrict z = q->z, *restrict inv = q->inv;
        if (inside)
            for (int64_t i = 0; i < hd; i++) c[i] = quantize_in_range(x[i], z[i], inv[i]);
        else
            for (int64_t i = 0; i < hd; i++) c[i] = quantize(x[i], z[i], inv[i]);
        return;
    }
    for (int64_t j = 0; j < hd / g; j++) {
        const float z = q->z[at + j], inv = q->inv[at + j];
        if (inside)
            for (int64_t i = 0; i < g; i++) c[j * g + i] = quantize_in_range(x[j * g + i], z, inv);
        else
            for (int64_t i = 0; i < g; i++) c[j * g + i] = quantize(x[j * g + i], z, inv);
    }
}

/* v = scale * (code + mid) + zero, two roundings (mid: the Anchor's bucket midpoint, or 0). */
INLINE void dequant_row(const geo_t *G, const groups_t *q, int64_t at, const uint8_t *restrict c,
                        float mid, float *restrict v) {
    const int64_t hd = G->hd, g = G->g;
    if (G->over) {
        const float *restrict s = q->s, *restrict z = q->z;
        for (int64_t i = 0; i < hd; i++) {
            const float t = s[i] * ((float)c[i] + mid);
            v[i] = t + z[i];
        }
        return;
    }
    for (int64_t j = 0; j < hd / g; j++) {
        const float s = q->s[at + j], z = q->z[at + j];
        for (int64_t i = 0; i < g; i++) {
            const float t = s * ((float)c[j * g + i] + mid);
            v[j * g + i] = t + z;
        }
    }
}

/* ---- values in and out of the pool dtype ---- */

/* A pool row as fp32. Returns 1 if the reference refuses it: a NaN (target exact) or any
 * non-finite value (int8). Exact: values with |x| >= limit (Inf included) become 0 (they reach the
 * decode through the correction's escapes). */
INLINE int load_row(const geo_t *G, const uint8_t *restrict src, float *restrict x) {
    const int64_t hd = G->hd;
    switch (G->p->dtype) {
        case DT_F32: memcpy(x, src, (size_t)hd * 4); break;
        case DT_F16: for (int64_t i = 0; i < hd; i++) x[i] = h2f(get16(src + 2 * i)); break;
        default: for (int64_t i = 0; i < hd; i++) x[i] = bits_f32((uint32_t)get16(src + 2 * i) << 16);
    }
    int bad = 0;
    if (!G->exact) {
        for (int64_t i = 0; i < hd; i++) bad |= !(__builtin_fabsf(x[i]) <= 3.402823466e38f);
        return bad;
    }
    const float lim = G->p->limit;
    for (int64_t i = 0; i < hd; i++) {
        const float f = x[i];
        bad |= f != f;
        x[i] = __builtin_fabsf(f) >= lim ? 0.0f : f;
    }
    return bad;
}

/* int8 target: 1 if some value is not below FP16_MAX in magnitude (NaN and Inf included). */
INLINE int out_of_range(const float *x, int64_t n) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= !(__builtin_fabsf(x[i]) < FP16_MAX);
    return bad;
}

INLINE void store_row(const geo_t *G, const float *restrict v, uint8_t *restrict dst) {
    const int64_t hd = G->hd;
    switch (G->p->dtype) {
        case DT_F32: memcpy(dst, v, (size_t)hd * 4); break;
        case DT_F16: for (int64_t i = 0; i < hd; i++) put16(dst + 2 * i, f2h(v[i])); break;
        default: for (int64_t i = 0; i < hd; i++) put16(dst + 2 * i, f2b(v[i]));
    }
}

/* The value bits (zero-extended) of value i of a row of the pool dtype. */
INLINE uint32_t value_bits(const geo_t *G, const uint8_t *row, int64_t i) {
    return G->vb == 4 ? get32(row + 4 * i) : get16(row + 2 * i);
}

/* ---- exact Residual: predictions, ordinals, classes (lynx_kernels.exact) ---- */

INLINE int32_t ord16(uint32_t b) { return (int32_t)(b & 0x7FFF) ^ -(int32_t)(b >> 15); }
INLINE int64_t ord32(uint32_t b) { return (int64_t)(b & 0x7FFFFFFFu) ^ -(int64_t)(b >> 31); }

INLINE int is_nan_bits(const geo_t *G, uint32_t bits) {
    if (G->vb == 4) return (bits & 0x7FFFFFFFu) > 0x7F800000u;
    if (G->p->dtype == DT_F16) return (bits & 0x7FFFu) > 0x7C00u;
    return (bits & 0x7FFFu) > 0x7F80u;
}

INLINE int bitlen(uint64_t v) { return v ? 64 - __builtin_clzll(v) : 0; }

INLINE int clamp_class(int c) { return c < 0 ? 0 : (c > NCLS - 1 ? NCLS - 1 : c); }

/* Twice the estimated bits of a value of bit length b coded with k (exact._cost2_table). */
static int64_t cost2(int b, int k, int wbits) {
    if (b <= k) return 2 * (1 + k);
    if (b - k <= 4) return 3 * ((int64_t)1 << (b - 1 - k)) - 1 + 2 * (1 + k);
    return 2 * (ESCAPE_Q + 1 + k + wbits);
}

/* e_s + class_offset of every value of a row (lynx_kernels.exact.scale_exponents). */
INLINE void row_scale_exponents(const geo_t *G, const groups_t *q, int64_t at, int8_t *restrict es) {
    const int64_t hd = G->hd, g = G->g, D = G->D, H = G->H;
    const int off = G->p->class_offset;
    const uint16_t *restrict sb = q->sb + (G->over ? 0 : at);
    if (G->over) {
        for (int64_t i = 0; i < hd; i++) es[i] = (int8_t)(((sb[i] >> 10) & 0x1F) - 15 + off);
    } else {
        for (int64_t j = 0; j < hd / g; j++) {
            const int8_t e = (int8_t)(((sb[j] >> 10) & 0x1F) - 15 + off);
            for (int64_t i = 0; i < g; i++) es[j * g + i] = e;
        }
    }
    if (G->rotate) {
        for (int64_t h = 0; h < H; h++) {
            int8_t *restrict eh = es + h * D, m = eh[0];
            for (int64_t j = 1; j < D; j++) m = eh[j] > m ? eh[j] : m;
            for (int64_t j = 0; j < D; j++) eh[j] = m;
        }
    }
}

/* The prediction of a row from its codes: unrotated INT8 reconstruction, in v (fp32). */
INLINE void predict_row(const geo_t *G, const groups_t *q, int64_t at, const uint8_t *codes, float *v) {
    dequant_row(G, q, at, codes, 0.0f, v);
    if (G->rotate) row_transform(G, v, 1);
}

/* Per value of a row: (zz << 4) | class (encode: x given) or (r bits << 4) | class (decode: x
 * NULL), u32 for 16-bit dtypes, u64 for fp32. `es` holds e_s + class_offset. */
INLINE void exact_row(const geo_t *G, const float *restrict v, const int8_t *restrict es,
                      const uint8_t *restrict x, void *restrict out) {
    const int64_t hd = G->hd;
    if (G->p->dtype == DT_F32) {
        uint64_t *restrict o = out;
        for (int64_t i = 0; i < hd; i++) {
            const uint32_t rb = f32_bits(v[i]);
            const int c = clamp_class(es[i] - ((int)((rb >> 23) & 0xFF) - 127));
            const int64_t d = x ? ord32(get32(x + 4 * i)) - ord32(rb) : 0;
            const uint64_t zz = ((uint64_t)d << 1) ^ (0 - (uint64_t)(d < 0));
            o[i] = ((x ? zz : (uint64_t)rb) << 4) | (uint64_t)c;
        }
        return;
    }
    uint32_t *restrict o = out;
    if (G->p->dtype == DT_F16) {
        for (int64_t i = 0; i < hd; i++) {
            const uint32_t rb = f2h(v[i]);
            const int c = clamp_class(es[i] - ((int)((rb >> 10) & 0x1F) - 15));
            const int32_t d = x ? ord16(get16(x + 2 * i)) - ord16(rb) : 0;
            const uint32_t zz = ((uint32_t)d << 1) ^ (0 - (uint32_t)(d < 0));
            o[i] = ((x ? zz : rb) << 4) | (uint32_t)c;
        }
        return;
    }
    for (int64_t i = 0; i < hd; i++) {
        const uint32_t rb = f2b(v[i]);
        const int c = clamp_class(es[i] - ((int)((rb >> 7) & 0xFF) - 127));
        const int32_t d = x ? ord16(get16(x + 2 * i)) - ord16(rb) : 0;
        const uint32_t zz = ((uint32_t)d << 1) ^ (0 - (uint32_t)(d < 0));
        o[i] = ((x ? zz : rb) << 4) | (uint32_t)c;
    }
}

/* ---- exact Residual section: encoder ---- */

/* A branch-free bit writer: each put stores 8 bytes at the current byte (the buffer needs 8 bytes of
 * slack) and keeps under 8 pending bits; fields are at most 32 bits. */
typedef struct {
    uint8_t *p;
    uint64_t acc;
    int nbits;
} bitw_t;

INLINE void bw_put(bitw_t *w, uint64_t val, int len) {
    w->acc |= val << w->nbits;
    w->nbits += len;
    put64(w->p, w->acc);
    const int adv = w->nbits >> 3;
    w->p += adv;
    w->acc >>= 8 * adv;
    w->nbits &= 7;
}

/* ORs bits [0, nbits) of `src` into `dst` from bit `at` on: 7 bytes at a time, so a shift of up to
 * 7 fits a word. Bits of src past nbits must be zero up to 8 bytes on (bw_put leaves them so). */
INLINE void or_bits(uint8_t *dst, int64_t at, const uint8_t *src, int64_t nbits) {
    uint8_t *d = dst + (at >> 3);
    const int sh = (int)(at & 7);
    for (int64_t j = 0; j < (nbits + 7) / 8; j += 7)
        put64(d + j, get64(d + j) | ((get64(src + j) & 0x00FFFFFFFFFFFFFFull) << sh));
}

typedef struct {
    void *zc;          /* per coded value of the chunk: exact_row's output */
    int64_t *blk;      /* per block: L bits, U bits, record bytes, escapes */
    uint8_t *records;  /* the records (encode) / a padded copy of them (decode) */
    uint8_t *area;     /* encode: one block's L then U area, before they are joined */
} section_scratch_t;

INLINE uint64_t zc_at(const void *zc, const int wide, int64_t i) {
    return wide ? ((const uint64_t *)zc)[i] : ((const uint32_t *)zc)[i];
}

/* The k table of a chunk from one histogram of (class, bitlen(zz)): per class the k with the
 * least estimated bits (exact.encode_sections' rule). */
INLINE void choose_k(const geo_t *G, const void *zc, const int wide, int64_t nv, int *knib) {
    /* Every HIST_STRIDE-th value (exact.HIST_STRIDE), into four interleaved sub-histograms:
     * consecutive samples often hit the same bin, and one counter would serialize on itself. */
    uint32_t sub[4][NCLS * BITLEN_BINS];
    memset(sub, 0, sizeof sub);
    int64_t i = 0;
    for (; i + 3 * HIST_STRIDE < nv; i += 4 * HIST_STRIDE)
        for (int j = 0; j < 4; j++) {
            const uint64_t v = zc_at(zc, wide, i + j * HIST_STRIDE);
            sub[j][(v & 15) * BITLEN_BINS + bitlen(v >> 4)]++;
        }
    for (; i < nv; i += HIST_STRIDE) {
        const uint64_t v = zc_at(zc, wide, i);
        sub[0][(v & 15) * BITLEN_BINS + bitlen(v >> 4)]++;
    }
    for (int c = 0; c < NCLS; c++) {
        int64_t best = -1;
        knib[c] = 0;
        for (int j = 0; j < 16; j++) {
            int64_t cost = 0;
            for (int b = 0; b < BITLEN_BINS; b++) {
                const int x = c * BITLEN_BINS + b;
                const int64_t count = (int64_t)sub[0][x] + sub[1][x] + sub[2][x] + sub[3][x];
                if (count) cost += count * cost2(b, G->p->k_base + j, G->wbits);
            }
            if (best < 0 || cost < best) {
                best = cost;
                knib[c] = j;
            }
        }
    }
}

INLINE int64_t section_encode_w(const geo_t *G, section_scratch_t *S, int64_t nv, const uint8_t *pool,
                                const int64_t *slots, int64_t kept0, int64_t budget, uint8_t *out,
                                const int wide) {
    const void *zc = S->zc;
    const int64_t hd = G->hd;
    const int wbits = G->wbits;
    int knib[NCLS], kk[NCLS];
    choose_k(G, zc, wide, nv, knib);
    for (int c = 0; c < NCLS; c++) kk[c] = knib[c] + G->p->k_base;
    const int64_t nb = num_blocks(nv);
    int64_t *restrict blk = S->blk;
    int64_t total = 0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i1 = (b + 1) * BLOCK < nv ? (b + 1) * BLOCK : nv;
        int64_t sl = 0, su = 0, ne = 0;
        for (int64_t i = b * BLOCK; i < i1; i++) {
            const uint64_t v = zc_at(zc, wide, i);
            const int k = kk[v & 15];
            const uint64_t q = (v >> 4) >> k;
            const int esc = q >= ESCAPE_Q;
            sl += k;
            su += (esc ? ESCAPE_Q : (int64_t)q) + 1;
            ne += esc;
        }
        blk[4 * b] = sl;
        blk[4 * b + 1] = su;
        blk[4 * b + 2] = (sl + su + ne * wbits + 7) / 8;
        blk[4 * b + 3] = ne;
        total += blk[4 * b + 2];
    }
    const int64_t len = 8 + 2 * nb + total;
    if (len > budget) return -1;
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)(knib[2 * i] | (knib[2 * i + 1] << 4));
    for (int64_t b = 0; b < nb; b++) put16(out + 8 + 2 * b, (uint16_t)blk[4 * b + 2]);
    uint8_t *rec = S->records, *ua = S->area + BLOCK * 8; /* L area at S->area, U area at ua */
    memset(rec, 0, (size_t)total + 16);
    int64_t start = 0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i1 = (b + 1) * BLOCK < nv ? (b + 1) * BLOCK : nv;
        const int64_t sl = blk[4 * b], su = blk[4 * b + 1];
        /* Two branch-free writers in registers (each put stores 8 bytes and keeps < 8 pending
         * bits): the L area's low bits, and the U area's unary codes. */
        uint8_t *lp = S->area, *up = ua;
        uint64_t lacc = 0, uacc = 0;
        int ln = 0, un = 0;
        for (int64_t i = b * BLOCK; i < i1; i++) {
            const uint64_t v = zc_at(zc, wide, i), zz = v >> 4;
            const int k = kk[v & 15];
            const uint64_t q = zz >> k;
            const int esc = q >= ESCAPE_Q;
            lacc |= (esc ? 0 : zz & (((uint64_t)1 << k) - 1)) << ln;
            ln += k;
            put64(lp, lacc);
            lp += ln >> 3;
            lacc >>= ln & ~7;
            ln &= 7;
            const int ulen = esc ? ESCAPE_Q + 1 : (int)q + 1;
            uacc |= (((uint64_t)1 << (ulen - 1)) - 1) << un;
            un += ulen;
            put64(up, uacc);
            up += un >> 3;
            uacc >>= un & ~7;
            un &= 7;
        }
        put64(lp, lacc);
        put64(up, uacc);
        uint8_t *r = rec + start;
        memcpy(r, S->area, (size_t)((sl + 7) / 8));
        or_bits(r, sl, ua, su);
        if (blk[4 * b + 3]) { /* escapes: x's raw bits, after the U area */
            bitw_t E = {r + (sl + su) / 8, r[(sl + su) / 8], (int)((sl + su) & 7)};
            for (int64_t i = b * BLOCK; i < i1; i++) {
                const uint64_t v = zc_at(zc, wide, i);
                if (((v >> 4) >> kk[v & 15]) >= ESCAPE_Q)
                    bw_put(&E, value_bits(G, pool_row(G, pool, slots[kept0 + i / hd]), i % hd), wbits);
            }
        }
        start += blk[4 * b + 2];
    }
    memcpy(out + 8 + 2 * nb, rec, (size_t)total);
    return len;
}

/* Codes the chunk's `nv` values into `out` (k table, record lengths, records) if that takes at
 * most `budget` bytes; returns the bytes written, or -1 (nothing written) if it does not fit.
 * Escapes read x from the pool: value i is token kept0 + i / hd, column i % hd. */
LYNX_CLONES
static int64_t section_encode(const geo_t *G, section_scratch_t *S, int64_t nv, const uint8_t *pool,
                              const int64_t *slots, int64_t kept0, int64_t budget, uint8_t *out) {
    return G->vb == 4 ? section_encode_w(G, S, nv, pool, slots, kept0, budget, out, 1)
                      : section_encode_w(G, S, nv, pool, slots, kept0, budget, out, 0);
}

/* ---- encode ---- */

typedef struct {
    float *x;           /* [block][hd] fp32 values (rotated) */
    float *v;           /* [hd] prediction */
    float *lo, *hi;     /* [hd] */
    uint8_t *codes;     /* [hd] */
    int8_t *es;         /* [hd] */
    groups_t q;         /* the block's groups */
    section_scratch_t S;
} enc_scratch_t;

/* Where a chunk's pieces go while its rows are encoded. */
typedef struct {
    uint8_t *anchor, *low, *zero, *scale, *prot;
    int64_t c0, nprot, nv;
    int residual; /* 0: Anchor only (low bits go to scratch, no corrections are coded) */
} chunk_out_t;

static void free_all(void **ptrs, int n) {
    for (int i = 0; i < n; i++) free(ptrs[i]);
}

/* Per-token groups of a row: min/max of each run of g values. */
INLINE void row_minmax(const float *restrict x, int64_t hd, int64_t g, float *restrict lo,
                       float *restrict hi) {
    for (int64_t j = 0; j < hd / g; j++) {
        const float *xg = x + j * g;
        v8f l = vload(xg), h = l;
        for (int64_t i = 8; i < g; i += 8) {
            const v8f y = vload(xg + i);
            l = (v8f)(((v8i)y & (y < l)) | ((v8i)l & ~(y < l)));
            h = (v8f)(((v8i)y & (y > h)) | ((v8i)h & ~(y > h)));
        }
        float a = l[0], b = h[0];
        for (int i = 1; i < 8; i++) {
            a = l[i] < a ? l[i] : a;
            b = h[i] > b ? h[i] : b;
        }
        lo[j] = a;
        hi[j] = b;
    }
}

/* int8 target: 1 if some group's values reach FP16_MAX in magnitude (the reference refuses). */
INLINE int groups_out_of_range(const float *restrict lo, const float *restrict hi, int64_t n) {
    int bad = 0;
    for (int64_t i = 0; i < n; i++) bad |= !(lo[i] > -FP16_MAX) | !(hi[i] < FP16_MAX);
    return bad;
}

/* Quantizes a prepared (rotated) row of token t and writes what it contributes to its chunk:
 * packed top and low bits, a protected row's original values, an exact row's corrections. */
INLINE void finish_row(const geo_t *G, enc_scratch_t *W, chunk_out_t *o, const uint8_t *pool,
                       const int64_t *slots, int64_t t, const float *x, int64_t at, int inside) {
    const int64_t hd = G->hd, i = t - o->c0;
    quantize_row(G, x, &W->q, at, W->codes, inside);
    pack_codes(W->codes, hd, G->a, o->anchor + i * hd * G->a / 8, o->low + i * hd * G->r / 8);
    const uint8_t *src = pool_row(G, pool, slots[t]);
    if (is_protected(G, t)) {
        memcpy(o->prot + o->nprot++ * hd * G->vb, src, (size_t)(hd * G->vb));
    } else if (G->exact && o->residual) {
        predict_row(G, &W->q, at, W->codes, W->v);
        row_scale_exponents(G, &W->q, at, W->es);
        exact_row(G, W->v, W->es, src, (uint8_t *)W->S.zc + o->nv * G->vb * 2);
        o->nv += hd;
    }
}

LYNX_CLONES
static int encode_impl(const lynx_params *p, const uint8_t *pool, const int64_t *slots,
                       uint8_t *aout, int64_t acap, uint8_t *rout, int64_t rcap, int64_t *written,
                       err_t *e) {
    geo_t G;
    geo_init(&G, p);
    const int64_t hd = G.hd, n = G.n, ct = p->chunk_tokens;
    /* Groups over tokens need a block's statistics before quantizing it; per-token rows are
     * done one at a time, in L1. */
    const int64_t B = G.over ? G.g : 1;
    const int64_t gpr = G.over ? hd : hd / G.g; /* groups per row */
    const int64_t chunk_values = (ct < n ? ct : n) * hd;
    enc_scratch_t W;
    void *ptrs[20];
    int np = 0;
    ptrs[np++] = W.x = xalloc(B * hd * 4);
    ptrs[np++] = W.v = xalloc(hd * 4);
    ptrs[np++] = W.lo = xalloc(hd * 4);
    ptrs[np++] = W.hi = xalloc(hd * 4);
    ptrs[np++] = W.codes = xalloc(hd);
    ptrs[np++] = W.es = xalloc(hd);
    ptrs[np++] = W.q.zb = xalloc(gpr * 2);
    ptrs[np++] = W.q.sb = xalloc(gpr * 2);
    ptrs[np++] = W.q.z = xalloc(gpr * 4);
    ptrs[np++] = W.q.s = xalloc(gpr * 4);
    ptrs[np++] = W.q.inv = xalloc(gpr * 4);
    const int need = np;
    /* Without a Residual buffer only the Anchor is written: the low bits still come out of the
     * packing (into scratch) but no exact correction is computed or coded. */
    const int residual = rout != NULL;
    const int coding = G.exact && residual;
    uint8_t *low_scratch = residual ? NULL : xalloc(chunk_values * G.r / 8 + 8);
    if (!residual && !low_scratch) {
        free_all(ptrs, np);
        return fail(e, LYNX_E_NOMEM, "out of memory for the codec's scratch");
    }
    ptrs[np++] = low_scratch;
    ptrs[np++] = W.S.zc = coding ? xalloc(chunk_values * G.vb * 2) : NULL;
    ptrs[np++] = W.S.blk = coding ? xalloc(num_blocks(chunk_values) * 32) : NULL;
    ptrs[np++] = W.S.records = coding ? xalloc(chunk_values * G.vb + 64) : NULL;
    ptrs[np++] = W.S.area = coding ? xalloc(2 * BLOCK * 8 + 64) : NULL;
    for (int i = 0; i < np; i++)
        if (!ptrs[i] && (i < need || (i > need && coding))) {
            free_all(ptrs, np);
            return fail(e, LYNX_E_NOMEM, "out of memory for the codec's scratch");
        }
    int64_t apos = 0, rpos = 0;
    int bad = 0, rc = LYNX_OK;
    for (int64_t c0 = 0; c0 < n && !bad; c0 += ct) {
        const int64_t c1 = c0 + ct < n ? c0 + ct : n, nc = c1 - c0;
        const int64_t alen = anchor_payload_len(&G, c0, c1);
        if (apos + HEADER_SIZE + alen > acap ||
            (residual && rpos + HEADER_SIZE + residual_bound(&G, nc) > rcap)) {
            rc = fail(e, LYNX_E_BUFFER, "output buffer too small for the chunk of tokens [%lld, %lld)",
                      (long long)c0, (long long)c1);
            break;
        }
        chunk_out_t o;
        o.anchor = aout + apos + HEADER_SIZE;
        o.low = residual ? rout + rpos + HEADER_SIZE : low_scratch;
        o.residual = residual;
        o.zero = o.anchor + nc * hd * G.a / 8;
        o.scale = o.zero + 2 * group_count(&G, nc);
        o.prot = o.scale + 2 * group_count(&G, nc);
        o.c0 = c0;
        o.nprot = o.nv = 0;
        int64_t kept0, kept1;
        kept_range(&G, c0, c1, &kept0, &kept1);
        for (int64_t b0 = c0; b0 < c1 && !bad; b0 += B) {
            const int64_t b1 = b0 + B < c1 ? b0 + B : c1;
            int64_t k0, k1;
            kept_range(&G, b0, b1, &k0, &k1);
            for (int64_t t = b0; t < b1; t++) {
                float *x = W.x + (t - b0) * hd;
                bad |= load_row(&G, pool_row(&G, pool, slots[t]), x);
                if (G.rotate) row_transform(&G, x, 0);
                if (!G.over) {
                    row_minmax(x, hd, G.g, W.lo, W.hi);
                    if (!G.exact) bad |= groups_out_of_range(W.lo, W.hi, gpr);
                    const int clamped = group_params(W.lo, W.hi, gpr, &W.q, 0);
                    memcpy(o.zero + 2 * (t - c0) * gpr, W.q.zb, (size_t)gpr * 2);
                    memcpy(o.scale + 2 * (t - c0) * gpr, W.q.sb, (size_t)gpr * 2);
                    finish_row(&G, &W, &o, pool, slots, t, x, 0, !clamped);
                } else if (t < k0 || t >= k1) {
                    if (!G.exact) bad |= out_of_range(x, hd); /* not in the statistics */
                } else if (t == k0) {
                    memcpy(W.lo, x, (size_t)hd * 4);
                    memcpy(W.hi, x, (size_t)hd * 4);
                } else {
                    float *restrict lo = W.lo, *restrict hi = W.hi;
                    for (int64_t i = 0; i < hd; i++) {
                        lo[i] = x[i] < lo[i] ? x[i] : lo[i];
                        hi[i] = x[i] > hi[i] ? x[i] : hi[i];
                    }
                }
            }
            if (!G.over || bad) continue;
            if (k1 == k0) {
                memset(W.lo, 0, (size_t)hd * 4);
                memset(W.hi, 0, (size_t)hd * 4);
            } else if (!G.exact) {
                bad |= groups_out_of_range(W.lo, W.hi, hd);
            }
            const int clamped = group_params(W.lo, W.hi, hd, &W.q, 0);
            const int64_t row = (b0 - c0) / G.g;
            memcpy(o.zero + 2 * row * hd, W.q.zb, (size_t)hd * 2);
            memcpy(o.scale + 2 * row * hd, W.q.sb, (size_t)hd * 2);
            /* protected rows are not in the statistics */
            for (int64_t t = b0; t < b1; t++)
                finish_row(&G, &W, &o, pool, slots, t, W.x + (t - b0) * hd, 0,
                           !clamped && t >= k0 && t < k1);
        }
        if (bad) break;
        put_header(aout + apos, &G, STREAM_ANCHOR, p->flags, c0, c1, alen);
        apos += HEADER_SIZE + alen;
        if (!residual) continue;
        int64_t rlen = low_len(&G, nc);
        int flags = p->flags;
        if (G.exact) {
            const int64_t raw = nc * hd * G.vb;
            const int64_t sec = section_encode(&G, &W.S, o.nv, pool, slots, kept0, raw - rlen, o.low + rlen);
            if (sec >= 0) {
                rlen += sec;
            } else {
                for (int64_t t = c0; t < c1; t++)
                    memcpy(o.low + (t - c0) * hd * G.vb, pool_row(&G, pool, slots[t]), (size_t)(hd * G.vb));
                rlen = raw;
                flags |= FLAG_RAW;
            }
        }
        put_header(rout + rpos, &G, STREAM_RESIDUAL, flags, c0, c1, rlen);
        rpos += HEADER_SIZE + rlen;
    }
    if (bad && rc == LYNX_OK)
        rc = fail(e, LYNX_E_INPUT, G.exact ? "NaN in the input" : "non-finite or out-of-range input");
    written[0] = apos;
    written[1] = rpos;
    free_all(ptrs, np);
    return rc;
}

/* ---- apply: validation ---- */

typedef struct {
    int64_t start, end, len;
    const uint8_t *payload;
    int raw;
} chunk_t;

static int check_header(const geo_t *G, int stream, const uint8_t *h, int64_t start, err_t *e) {
    const lynx_params *p = G->p;
    const char *what = stream == STREAM_ANCHOR ? "Anchor" : "Residual";
    if (memcmp(h, "LYNX", 4) != 0) return fail(e, LYNX_E_CHUNK, "not a Lynx chunk (bad magic)");
    if (h[4] != FORMAT_VERSION)
        return fail(e, LYNX_E_CHUNK,
                    "chunk format version %d, this codec reads %d: prefill and decode run different "
                    "lynx-sglang versions", h[4], FORMAT_VERSION);
    if (h[5] != stream) return fail(e, LYNX_E_CHUNK, "expected an %s chunk, got stream %d", what, h[5]);
    int flags = h[8];
    if (stream == STREAM_RESIDUAL && G->exact) flags &= ~FLAG_RAW;
    if (h[6] != p->kind || h[7] != p->dtype || flags != p->flags || h[9] != p->anchor_bits ||
        get16(h + 10) != p->group_size || get16(h + 18) != p->sink || get16(h + 20) != p->recent ||
        get32(h + 22) != p->seed)
        return fail(e, LYNX_E_CHUNK, "%s chunk's codec settings (kind, dtype, flags, bits, group, "
                    "sink/recent, seed) differ from this run's", what);
    if (get16(h + 12) != p->layer || get16(h + 14) != p->heads || get16(h + 16) != p->head_dim ||
        get64(h + 26) != p->request_tag || get32(h + 34) != (uint64_t)p->total_tokens)
        return fail(e, LYNX_E_CHUNK, "%s chunk of layer %d (tag %llu, %u tokens, %dx%d) does not "
                    "belong to this run", what, get16(h + 12), (unsigned long long)get64(h + 26),
                    get32(h + 34), get16(h + 14), get16(h + 16));
    const int64_t s = get32(h + 38), t = get32(h + 42);
    if (s != start || !(s < t && t <= G->n) || (G->over && s % G->g))
        return fail(e, LYNX_E_CHUNK, "%s chunks do not tile the run: expected one starting at "
                    "token %lld, got [%lld, %lld)", what, (long long)start, (long long)s, (long long)t);
    return LYNX_OK;
}

static int check_payload(const geo_t *G, int stream, const chunk_t *c, err_t *e) {
    const int64_t nc = c->end - c->start;
    const int64_t bound = stream == STREAM_ANCHOR ? anchor_payload_len(G, c->start, c->end)
                                                  : residual_bound(G, nc);
    if (!(stream == STREAM_RESIDUAL && G->exact && !c->raw)) {
        if (c->len != bound)
            return fail(e, LYNX_E_CHUNK, "chunk of tokens [%lld, %lld): payload_len %lld does not "
                        "match the %lld bytes its parameters imply", (long long)c->start,
                        (long long)c->end, (long long)c->len, (long long)bound);
        return LYNX_OK;
    }
    const int64_t nv = (nc - protected_count(G, c->start, c->end)) * G->hd;
    const int64_t at = low_len(G, nc) + 8 + 2 * num_blocks(nv);
    if (c->len > bound || c->len < at)
        return fail(e, LYNX_E_CHUNK, "exact Residual chunk of tokens [%lld, %lld): payload_len %lld "
                    "outside [%lld, %lld]", (long long)c->start, (long long)c->end,
                    (long long)c->len, (long long)at, (long long)bound);
    int64_t sum = 0;
    const uint8_t *lens = c->payload + low_len(G, nc) + 8;
    for (int64_t b = 0; b < num_blocks(nv); b++) sum += get16(lens + 2 * b);
    if (at + sum != c->len)
        return fail(e, LYNX_E_CHUNK, "exact Residual chunk of tokens [%lld, %lld): record lengths "
                    "sum to %lld bytes, the payload holds %lld", (long long)c->start,
                    (long long)c->end, (long long)sum, (long long)(c->len - at));
    return LYNX_OK;
}

/* Validates every chunk of a stream's bytes for this run (header fields, token tiling [0, n),
 * payload lengths, CRC); with `match`, the chunks must have its token ranges. */
static int walk(const geo_t *G, int stream, const uint8_t *buf, int64_t len, const chunk_t *match,
                int64_t nmatch, chunk_t **out, int64_t *count, err_t *e) {
    const char *what = stream == STREAM_ANCHOR ? "Anchor" : "Residual";
    int64_t cap = 16, k = 0, pos = 0, start = 0;
    chunk_t *arr = malloc(sizeof(chunk_t) * cap);
    if (!arr) return fail(e, LYNX_E_NOMEM, "out of memory");
    int rc = LYNX_OK;
    while (pos < len) {
        if (len - pos < HEADER_SIZE) {
            rc = fail(e, LYNX_E_CHUNK, "%s bytes end inside a chunk header at byte %lld of %lld",
                      what, (long long)pos, (long long)len);
            break;
        }
        const uint8_t *h = buf + pos;
        const int64_t plen = get32(h + 46), end = pos + HEADER_SIZE + plen;
        if (end > len) {
            rc = fail(e, LYNX_E_CHUNK, "%s chunk at byte %lld runs past the end (%lld > %lld)", what,
                      (long long)pos, (long long)end, (long long)len);
            break;
        }
        if ((rc = check_header(G, stream, h, start, e)) != LYNX_OK) break;
        chunk_t c = {get32(h + 38), get32(h + 42), plen, h + HEADER_SIZE, (h[8] & FLAG_RAW) != 0};
        if ((rc = check_payload(G, stream, &c, e)) != LYNX_OK) break;
        uint8_t zeroed[HEADER_SIZE];
        memcpy(zeroed, h, HEADER_SIZE);
        put32(zeroed + 50, 0);
        if (crc32_update(crc32_update(0, zeroed, HEADER_SIZE), c.payload, plen) != get32(h + 50)) {
            rc = fail(e, LYNX_E_CHUNK, "%s chunk of tokens [%lld, %lld): checksum mismatch (corrupt "
                      "chunk)", what, (long long)c.start, (long long)c.end);
            break;
        }
        if (match && (k >= nmatch || match[k].start != c.start || match[k].end != c.end)) {
            rc = fail(e, LYNX_E_CHUNK, "Residual chunk of tokens [%lld, %lld) has no Anchor chunk "
                      "of the same tokens", (long long)c.start, (long long)c.end);
            break;
        }
        if (k == cap) {
            chunk_t *grown = realloc(arr, sizeof(chunk_t) * (cap *= 2));
            if (!grown) {
                rc = fail(e, LYNX_E_NOMEM, "out of memory");
                break;
            }
            arr = grown;
        }
        arr[k++] = c;
        start = c.end;
        pos = end;
    }
    if (rc == LYNX_OK && start != G->n)
        rc = fail(e, LYNX_E_CHUNK, "%s chunks cover tokens [0, %lld) of %lld", what,
                  (long long)start, (long long)G->n);
    if (rc != LYNX_OK) {
        free(arr);
        return rc;
    }
    *out = arr;
    *count = k;
    return LYNX_OK;
}

static int check_slots(const geo_t *G, const int64_t *slots, err_t *e) {
    for (int64_t t = 0; t < G->n; t++)
        if (slots[t] < 0 || slots[t] >= G->p->pool_rows)
            return fail(e, LYNX_E_ARG, "slot %lld of token %lld is outside the pool's %lld rows",
                        (long long)slots[t], (long long)t, (long long)G->p->pool_rows);
    return LYNX_OK;
}

/* ---- apply: decoding ---- */

typedef struct {
    float *v;
    uint8_t *codes;
    int8_t *es;
    groups_t q;
    uint8_t *out;       /* exact: [n][hd] values, scattered into the pool once all checked out */
    section_scratch_t S;
} dec_scratch_t;

/* The groups of token t of an Anchor chunk into W->q, unless already there (`*cur`: their row). */
INLINE void load_groups(const geo_t *G, const chunk_t *c, int64_t t, groups_t *q, int64_t *cur) {
    const int64_t row = G->over ? (t - c->start) / G->g : t - c->start;
    if (row == *cur) return;
    const int64_t nc = c->end - c->start, ngroups = group_count(G, nc);
    const int64_t gpr = G->over ? G->hd : G->hd / G->g;
    const uint8_t *zero = c->payload + nc * G->hd * G->a / 8, *scale = zero + 2 * ngroups;
    groups_from_bits(zero + 2 * row * gpr, scale + 2 * row * gpr, gpr, q);
    *cur = row;
}

INLINE const uint8_t *chunk_protected(const geo_t *G, const chunk_t *c) {
    const int64_t nc = c->end - c->start;
    return c->payload + nc * G->hd * G->a / 8 + 4 * group_count(G, nc);
}

/* The codes of token t: the Anchor's top bits joined with the Residual's low bits (res NULL:
 * the top bits alone). */
INLINE void chunk_codes(const geo_t *G, const chunk_t *a, const chunk_t *res, int64_t t, uint8_t *c) {
    const int64_t i = t - a->start;
    unpack_codes(a->payload + i * G->hd * G->a / 8, res ? res->payload + i * G->hd * G->r / 8 : NULL,
                 G->hd, G->a, c);
}

/* Writes the Anchor reconstruction (or, with `res`, the INT8 one) of an Anchor chunk's tokens. */
LYNX_CLONES
static void decode_int8_chunk(const geo_t *G, dec_scratch_t *W, const chunk_t *a, const chunk_t *res,
                              uint8_t *pool, const int64_t *slots) {
    const int64_t rowb = G->hd * G->vb;
    const float mid = res ? 0.0f : (float)((1 << G->r) - 1) / 2.0f;
    const uint8_t *prot = chunk_protected(G, a);
    int64_t np = 0, cur = -1;
    for (int64_t t = a->start; t < a->end; t++) {
        uint8_t *dst = pool + slots[t] * G->stride * G->vb;
        if (is_protected(G, t)) {
            memcpy(dst, prot + np++ * rowb, (size_t)rowb);
            continue;
        }
        load_groups(G, a, t, &W->q, &cur);
        chunk_codes(G, a, res, t, W->codes);
        dequant_row(G, &W->q, 0, W->codes, mid, W->v);
        if (G->rotate) row_transform(G, W->v, 1);
        store_row(G, W->v, dst);
    }
}

/* ---- exact Residual section: decoder ---- */

INLINE uint64_t peek(const uint8_t *data, int64_t pos) { return get64(data + (pos >> 3)) >> (pos & 7); }

static int corrupt(err_t *e, const char *what) {
    return fail(e, LYNX_E_CHUNK, "corrupt exact Residual section: %s", what);
}

/* Decodes a coded chunk's corrections against its `nv` predictions (S->zc: r bits and class per
 * value) into `out` (value i at out[i]: the chunk's unprotected values, row-major). */
INLINE int section_decode_w(const geo_t *G, section_scratch_t *S, const uint8_t *sec, int64_t sec_len,
                            int64_t nv, uint8_t *restrict out, err_t *e, const int wide) {
    int kk[NCLS];
    for (int i = 0; i < 8; i++) {
        kk[2 * i] = (sec[i] & 15) + G->p->k_base;
        kk[2 * i + 1] = (sec[i] >> 4) + G->p->k_base;
    }
    const int64_t nb = num_blocks(nv), total = sec_len - 8 - 2 * nb;
    uint8_t *data = S->records;
    memcpy(data, sec + 8 + 2 * nb, (size_t)total);
    memset(data + total, 0, 16);
    const void *zc = S->zc;
    const int wb = G->wbits;
    const int64_t half = (int64_t)1 << (wb - 1);
    /* magnitudes above nan_above are NaN */
    const uint32_t mag = wide ? 0x7FFFFFFFu : 0x7FFFu;
    const uint32_t nan_above = wide ? 0x7F800000u : (G->p->dtype == DT_F16 ? 0x7C00u : 0x7F80u);
    int64_t rs = 0, esc_idx[BLOCK];
    for (int64_t b = 0; b < nb; b++) {
        const int64_t re = rs + 8 * (int64_t)get16(sec + 8 + 2 * b);
        const int64_t i0 = b * BLOCK, i1 = i0 + BLOCK < nv ? i0 + BLOCK : nv;
        const int n = (int)(i1 - i0);
        /* the L area's low bits (reading past the record is harmless: data has slack) */
        uint32_t lows[BLOCK];
        int64_t pl = rs;
        for (int i = 0; i < n; i++) {
            const int k = kk[zc_at(zc, wide, i0 + i) & 15];
            lows[i] = (uint32_t)(peek(data, pl) & (((uint64_t)1 << k) - 1));
            pl += k;
        }
        if (pl > re) return corrupt(e, "a record is shorter than its low bits");
        /* then the U area, a word at a time: every zero bit ends a value's unary code, so the
         * codes come out of a trailing-zero count per value with no chain through memory. */
        uint8_t qs[BLOCK];
        int64_t pu = pl;
        int cnt = 0, run = 0;
        while (cnt < n) {
            const int64_t left = re - pu;
            if (left <= 0) return corrupt(e, "a unary code runs past its record");
            const int avail = left < 56 ? (int)left : 56;
            uint64_t z = ~peek(data, pu) & (((uint64_t)1 << avail) - 1); /* ones at the zeros */
            int base = 0;
            while (z && cnt < n) {
                const int t = __builtin_ctzll(z);
                const int q = run + t - base;
                if (q > ESCAPE_Q) return corrupt(e, "a unary code longer than 16");
                qs[cnt++] = (uint8_t)q;
                run = 0;
                base = t + 1;
                z &= z - 1;
            }
            if (cnt == n) {
                pu += base;
                break;
            }
            run += avail - base;
            if (run > ESCAPE_Q) return corrupt(e, "a unary code longer than 16");
            pu += avail;
        }
        /* then the values (a loop the compiler vectorizes; escapes are written over afterwards) */
        uint32_t bad = 0, nan = 0;
        int64_t ne = 0;
        if (wide) {
            const uint64_t *restrict zc64 = (const uint64_t *)zc + i0;
            for (int i = 0; i < n; i++) {
                const uint64_t v = zc64[i];
                const int k = kk[v & 15], esc = qs[i] == ESCAPE_Q;
                const uint64_t zz = ((uint64_t)qs[i] << k) | lows[i];
                const int64_t o = ord32((uint32_t)(v >> 4)) + (int64_t)((zz >> 1) ^ (0 - (zz & 1)));
                const uint32_t bits = o >= 0 ? (uint32_t)o : 0x80000000u | (uint32_t)(-1 - o);
                bad |= (uint32_t)((!esc) & ((o < -half) | (o >= half))) | (uint32_t)(esc & (lows[i] != 0));
                nan |= (uint32_t)((!esc) & ((bits & mag) > nan_above));
                ne += esc;
                put32(out + 4 * (i0 + i), bits);
            }
        } else {
            const uint32_t *restrict zc32 = (const uint32_t *)zc + i0;
            for (int i = 0; i < n; i++) {
                const uint32_t v = zc32[i];
                const int k = kk[v & 15], esc = qs[i] == ESCAPE_Q;
                const uint32_t zz = ((uint32_t)qs[i] << k) | lows[i];
                const int32_t o = ord16(v >> 4) + (int32_t)((zz >> 1) ^ (0 - (zz & 1)));
                const uint32_t bits = o >= 0 ? (uint32_t)o : 0x8000u | (uint32_t)(-1 - o);
                bad |= (uint32_t)((!esc) & ((o < -32768) | (o > 32767))) | (uint32_t)(esc & (lows[i] != 0));
                nan |= (uint32_t)((!esc) & ((bits & mag) > nan_above));
                ne += esc;
                put16(out + 2 * (i0 + i), (uint16_t)bits);
            }
        }
        if (bad) return corrupt(e, "a correction leaves the value range, or an escape has low bits");
        if (ne)
            for (int i = 0, j = 0; i < n; i++)
                if (qs[i] == ESCAPE_Q) esc_idx[j++] = i0 + i;
        const int64_t eend = pu + ne * wb;
        if (eend > re || eend <= re - 8) return corrupt(e, "a record length does not match its contents");
        if (re > eend && (peek(data, eend) & (((uint64_t)1 << (re - eend)) - 1)))
            return corrupt(e, "non-zero padding bits");
        for (int64_t j = 0; j < ne; j++) {
            const uint32_t bits = (uint32_t)(peek(data, pu + j * wb) & (((uint64_t)1 << wb) - 1));
            nan |= (bits & mag) > nan_above;
            if (wide) put32(out + 4 * esc_idx[j], bits);
            else put16(out + 2 * esc_idx[j], (uint16_t)bits);
        }
        if (nan) return corrupt(e, "a NaN value");
        rs = re;
    }
    return LYNX_OK;
}

LYNX_CLONES
static int section_decode(const geo_t *G, section_scratch_t *S, const uint8_t *sec, int64_t sec_len,
                          int64_t nv, uint8_t *out, err_t *e) {
    return G->vb == 4 ? section_decode_w(G, S, sec, sec_len, nv, out, e, 1)
                      : section_decode_w(G, S, sec, sec_len, nv, out, e, 0);
}

/* The exact values of a Residual chunk's tokens into W->out rows (validating its corrections). */
LYNX_CLONES
static int decode_exact_chunk(const geo_t *G, dec_scratch_t *W, const chunk_t *a, const chunk_t *res,
                              err_t *e) {
    const int64_t hd = G->hd, rowb = hd * G->vb, nc = a->end - a->start;
    const uint8_t *prot = chunk_protected(G, a);
    int64_t np = 0, cur = -1;
    if (res->raw) {
        for (int64_t i = 0; i < nc * hd; i++)
            if (is_nan_bits(G, value_bits(G, res->payload, i))) return corrupt(e, "a NaN value");
        memcpy(W->out + a->start * rowb, res->payload, (size_t)(nc * rowb));
    }
    int64_t kept0, kept1, nv = 0;
    kept_range(G, a->start, a->end, &kept0, &kept1);
    for (int64_t t = a->start; t < a->end; t++) {
        if (is_protected(G, t)) {
            memcpy(W->out + t * rowb, prot + np++ * rowb, (size_t)rowb);
            continue;
        }
        if (res->raw) continue;
        load_groups(G, a, t, &W->q, &cur);
        chunk_codes(G, a, res, t, W->codes);
        predict_row(G, &W->q, 0, W->codes, W->v);
        row_scale_exponents(G, &W->q, 0, W->es);
        exact_row(G, W->v, W->es, NULL, (uint8_t *)W->S.zc + nv * G->vb * 2);
        nv += hd;
    }
    if (res->raw) return LYNX_OK;
    const int64_t at = low_len(G, nc);
    return section_decode(G, &W->S, res->payload + at, res->len - at, nv,
                          W->out + kept0 * rowb, e);
}

LYNX_CLONES
static int apply_impl(const lynx_params *p, const uint8_t *abuf, int64_t alen, const uint8_t *rbuf,
                      int64_t rlen, uint8_t *pool, const int64_t *slots, err_t *e) {
    geo_t G;
    geo_init(&G, p);
    int rc = check_slots(&G, slots, e);
    if (rc != LYNX_OK) return rc;
    chunk_t *anchors = NULL, *residuals = NULL;
    int64_t na = 0, nr = 0;
    if ((rc = walk(&G, STREAM_ANCHOR, abuf, alen, NULL, 0, &anchors, &na, e)) != LYNX_OK) return rc;
    if (rbuf && (rc = walk(&G, STREAM_RESIDUAL, rbuf, rlen, anchors, na, &residuals, &nr, e)) != LYNX_OK) {
        free(anchors);
        return rc;
    }
    const int64_t hd = G.hd;
    int64_t maxc = 0;
    for (int64_t i = 0; i < na; i++)
        maxc = anchors[i].end - anchors[i].start > maxc ? anchors[i].end - anchors[i].start : maxc;
    const int exact = rbuf && G.exact;
    dec_scratch_t W;
    void *ptrs[12];
    int np = 0;
    ptrs[np++] = W.v = xalloc(hd * 4);
    ptrs[np++] = W.codes = xalloc(hd);
    ptrs[np++] = W.es = xalloc(hd);
    ptrs[np++] = W.q.zb = xalloc(hd * 2);
    ptrs[np++] = W.q.sb = xalloc(hd * 2);
    ptrs[np++] = W.q.z = xalloc(hd * 4);
    ptrs[np++] = W.q.s = xalloc(hd * 4);
    W.q.inv = NULL;
    const int need = np;
    ptrs[np++] = W.out = exact ? xalloc(G.n * hd * G.vb) : NULL;
    ptrs[np++] = W.S.zc = exact ? xalloc(maxc * hd * G.vb * 2) : NULL;
    ptrs[np++] = W.S.records = exact ? xalloc(maxc * hd * G.vb + 64) : NULL;
    W.S.blk = NULL;
    for (int i = 0; i < np && rc == LYNX_OK; i++)
        if (!ptrs[i] && (i < need || exact)) rc = fail(e, LYNX_E_NOMEM, "out of memory for the codec's scratch");
    if (rc == LYNX_OK) {
        if (!exact) {
            for (int64_t i = 0; i < na; i++)
                decode_int8_chunk(&G, &W, anchors + i, rbuf ? residuals + i : NULL, pool, slots);
        } else {
            for (int64_t i = 0; i < na && rc == LYNX_OK; i++)
                rc = decode_exact_chunk(&G, &W, anchors + i, residuals + i, e);
            if (rc == LYNX_OK)
                for (int64_t t = 0; t < G.n; t++)
                    memcpy(pool + slots[t] * G.stride * G.vb, W.out + t * hd * G.vb, (size_t)(hd * G.vb));
        }
    }
    free_all(ptrs, np);
    free(anchors);
    free(residuals);
    return rc;
}

/* ---- exported ---- */

void lynx_init(void) {
    crc_init();
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#endif
}

/* Which clone the CPU gets ("x86-64-v3" or "baseline"), for reports. */
const char *lynx_isa(void) {
#if defined(__x86_64__)
    return __builtin_cpu_supports("x86-64-v3") ? "x86-64-v3" : "baseline";
#else
    return "baseline";
#endif
}

uint32_t lynx_crc32(uint32_t crc, const uint8_t *buf, int64_t len) { return crc32_update(crc, buf, len); }

int lynx_encode_run(const lynx_params *p, const uint8_t *pool, const int64_t *slots, uint8_t *anchor_out,
                    int64_t anchor_cap, uint8_t *residual_out, int64_t residual_cap, int64_t *written,
                    char *err, int64_t errlen) {
    err_t e = {err, errlen};
    geo_t G;
    geo_init(&G, p);
    int rc = check_slots(&G, slots, &e);
    if (rc != LYNX_OK) return rc;
    return encode_impl(p, pool, slots, anchor_out, anchor_cap, residual_out, residual_cap, written, &e);
}

int lynx_apply_anchor_run(const lynx_params *p, const uint8_t *anchor, int64_t anchor_len, uint8_t *pool,
                          const int64_t *slots, char *err, int64_t errlen) {
    err_t e = {err, errlen};
    return apply_impl(p, anchor, anchor_len, NULL, 0, pool, slots, &e);
}

int lynx_apply_residual_run(const lynx_params *p, const uint8_t *anchor, int64_t anchor_len,
                            const uint8_t *residual, int64_t residual_len, uint8_t *pool,
                            const int64_t *slots, char *err, int64_t errlen) {
    err_t e = {err, errlen};
    return apply_impl(p, anchor, anchor_len, residual, residual_len, pool, slots, &e);
}
