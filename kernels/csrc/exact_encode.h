/* The exact Residual's section encoder (ClassRice-256 records).
 * Part of lynx_codec.c's single translation unit (included there, in order). */
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
