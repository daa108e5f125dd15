/* The exact Residual's section encoder (ClassRice-256 records).
 * Part of lynx_codec.c's single translation unit (included there, in order). */
/* ---- exact Residual section: encoder ---- */

typedef struct {
    void *zc;          /* per coded value of the chunk: exact_row's output */
    uint16_t *blk;     /* encode: per block, its record's byte length */
    uint8_t *records;  /* the records (encode) / a padded copy of them (decode) */
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
    /* The costs of every (bitlen, k) once, then per class only over the bit lengths it holds
     * (a handful): summing all 16 x 40 bins for each class was ~10 % of the section coder. */
    int64_t ct[BITLEN_BINS][16];
    for (int b = 0; b < BITLEN_BINS; b++)
        for (int j = 0; j < 16; j++) ct[b][j] = cost2(b, G->p->k_base + j, G->wbits);
    for (int c = 0; c < NCLS; c++) {
        int bins[BITLEN_BINS], m = 0;
        int64_t counts[BITLEN_BINS];
        for (int b = 0; b < BITLEN_BINS; b++) {
            const int x = c * BITLEN_BINS + b;
            const int64_t count = (int64_t)sub[0][x] + sub[1][x] + sub[2][x] + sub[3][x];
            if (count) {
                bins[m] = b;
                counts[m++] = count;
            }
        }
        int64_t best = -1;
        knib[c] = 0;
        for (int j = 0; j < 16; j++) {
            int64_t cost = 0;
            for (int i = 0; i < m; i++) cost += counts[i] * ct[bins[i]][j];
            if (best < 0 || cost < best) {
                best = cost;
                knib[c] = j;
            }
        }
    }
}

/* A block's values split into their fields: the k low bits of zz (0 for an escape), k, and the
 * unary length min(zz >> k, ESCAPE_Q). */
typedef struct {
    uint32_t lo[BLOCK];
    uint8_t k[BLOCK], q[BLOCK];
} fields_t;

/* Fields of values [i0, i0 + n) (a loop without a chain, so the compiler vectorizes it: k comes
 * out of the packed k table by k_of_class, not a table load); returns the record's bits
 * in L (*sl), U (*su) and the escapes' count (*ne). */
INLINE void block_fields(const void *zc, const int wide, int64_t i0, int n, uint64_t knibs, int k_base,
                         fields_t *restrict f, int64_t *sl, int64_t *su, int64_t *ne) {
    const uint32_t klo = (uint32_t)knibs, khi = (uint32_t)(knibs >> 32);
    int64_t l = 0, u = 0, e = 0;
    if (wide) {
        const uint64_t *restrict z = (const uint64_t *)zc + i0;
        for (int i = 0; i < n; i++) {
            const uint32_t c = (uint32_t)(z[i] & 15);
            const uint32_t k = k_of_class(c, klo, khi, (uint32_t)k_base);
            const uint64_t zz = z[i] >> 4, q = zz >> k;
            const int esc = q >= ESCAPE_Q;
            f->lo[i] = esc ? 0 : (uint32_t)(zz & (((uint64_t)1 << k) - 1));
            f->k[i] = (uint8_t)k;
            f->q[i] = (uint8_t)(esc ? ESCAPE_Q : q);
            l += k;
            u += (esc ? ESCAPE_Q : (int64_t)q) + 1;
            e += esc;
        }
    } else {
        const uint32_t *restrict z = (const uint32_t *)zc + i0;
        for (int i = 0; i < n; i++) {
            const uint32_t c = z[i] & 15;
            const uint32_t k = k_of_class(c, klo, khi, (uint32_t)k_base);
            const uint32_t zz = z[i] >> 4, q = zz >> k;
            const int esc = q >= ESCAPE_Q;
            f->lo[i] = esc ? 0 : zz & ((1u << k) - 1);
            f->k[i] = (uint8_t)k;
            f->q[i] = (uint8_t)(esc ? ESCAPE_Q : q);
            l += k;
            u += (esc ? ESCAPE_Q : q) + 1;
            e += esc;
        }
    }
    *sl = l;
    *su = u;
    *ne = e;
}

/* Appends `len` <= 56 bits to a writer that keeps under 8 pending bits (so nb + len < 64). */
#define BITS_APPEND(p, acc, nb, w, len)   \
    do {                                  \
        (acc) |= (uint64_t)(w) << (nb);   \
        (nb) += (len);                    \
        put64((p), (acc));                \
        (p) += (nb) >> 3;                 \
        (acc) >>= (nb) & ~7;              \
        (nb) &= 7;                        \
    } while (0)

INLINE int64_t section_encode_w(const geo_t *G, section_scratch_t *S, int64_t nv, const uint8_t *pool,
                                const int64_t *slots, int64_t kept0, int64_t budget, uint8_t *out,
                                const int wide) {
    const void *zc = S->zc;
    const int64_t hd = G->hd;
    const int wbits = G->wbits;
    int knib[NCLS];
    choose_k(G, zc, wide, nv, knib);
    uint64_t knibs = 0;
    for (int c = 0; c < NCLS; c++) knibs |= (uint64_t)knib[c] << (4 * c);
    const int64_t nb = num_blocks(nv), head = 8 + 2 * nb;
    /* L fields join in groups within BITS_APPEND's 56 bits (l_group: three for 16-bit dtypes,
     * two for fp32); U codes (at most 17 bits) always in threes. Fewer appends
     * means shorter chains through the writers, the loop's bound. */
    const int lg = l_group(G);
    fields_t f;
    int64_t start = 0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t i0 = b * BLOCK;
        const int n = (int)((i0 + BLOCK < nv ? i0 + BLOCK : nv) - i0);
        int64_t sl, su, ne;
        block_fields(zc, wide, i0, n, knibs, G->p->k_base, &f, &sl, &su, &ne);
        const int64_t len = (sl + su + ne * wbits + 7) / 8;
        if (head + start + len > budget) return -1;
        S->blk[b] = (uint16_t)len;
        /* One writer per record, L then U then E (running the L and U writers side by side,
         * U into scratch, measured no faster: the loop is bound by its operations, not by the
         * writer's chain). Every byte of the record is stored by a put64 while it is current or
         * complete, and bits past the pending ones are zero, so the records need no clearing. */
        uint8_t *p = S->records + start;
        uint64_t acc = 0;
        int bits = 0, i = 0;
        for (; i + lg <= n; i += lg) {
            uint64_t w = f.lo[i];
            int wl = f.k[i];
            for (int j = 1; j < lg; j++) {
                w |= (uint64_t)f.lo[i + j] << wl;
                wl += f.k[i + j];
            }
            BITS_APPEND(p, acc, bits, w, wl);
        }
        for (; i < n; i++) BITS_APPEND(p, acc, bits, f.lo[i], f.k[i]);
        for (i = 0; i + 3 <= n; i += 3) {
            const int q0 = f.q[i], q1 = f.q[i + 1], q2 = f.q[i + 2];
            const uint64_t w = (((uint64_t)1 << q0) - 1) | ((((uint64_t)1 << q1) - 1) << (q0 + 1)) |
                               ((((uint64_t)1 << q2) - 1) << (q0 + q1 + 2));
            BITS_APPEND(p, acc, bits, w, q0 + q1 + q2 + 3);
        }
        for (; i < n; i++) BITS_APPEND(p, acc, bits, ((uint64_t)1 << f.q[i]) - 1, f.q[i] + 1);
        if (ne) /* escapes: x's raw bits */
            for (i = 0; i < n; i++)
                if (f.q[i] == ESCAPE_Q)
                    BITS_APPEND(p, acc, bits,
                                value_bits(G, pool_row(G, pool, slots[kept0 + (i0 + i) / hd]), (i0 + i) % hd),
                                wbits);
        put64(p, acc);
        start += len;
    }
    for (int i = 0; i < 8; i++) out[i] = (uint8_t)(knib[2 * i] | (knib[2 * i + 1] << 4));
    for (int64_t b = 0; b < nb; b++) put16(out + 8 + 2 * b, S->blk[b]);
    memcpy(out + head, S->records, (size_t)start);
    return head + start;
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
