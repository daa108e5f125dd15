/* encode_impl: a run of pool rows into Anchor and Residual wire chunks.
 * Part of lynx_codec.c's single translation unit (included there, in order). */
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
    for (int i = 0; i < n; i++) xfree(ptrs[i]);
}

INLINE v16f vmin16(v16f a, v16f b) { const v16i m = a < b; return (v16f)(((v16i)a & m) | ((v16i)b & ~m)); }
INLINE v16f vmax16(v16f a, v16f b) { const v16i m = a > b; return (v16f)(((v16i)a & m) | ((v16i)b & ~m)); }

/* Per-token groups of a row: min/max of each run of g values (g is 32, 64 or 128: CodecSpec's
 * GROUP_SIZES, whole 16-value vectors). Each group's vectors are folded into one, then sixteen
 * groups at a time are reduced together: each step halves the lanes left per group and packs two
 * vectors' halves into one (4 steps for 16 groups, where one group at a time takes 4 steps of its
 * own), and the last vector holds the 16 results in order. Which of two equal zeros wins does not
 * matter (group_params turns -0 into +0), nor NaN (such a row is refused). */
INLINE void minmax_step(v16f *l, v16f *h, int n, const v16i lo_half, const v16i hi_half) {
    for (int i = 0; i < n; i++) {
        const v16f la = __builtin_shuffle(l[2 * i], l[2 * i + 1], lo_half);
        const v16f lb = __builtin_shuffle(l[2 * i], l[2 * i + 1], hi_half);
        const v16f ha = __builtin_shuffle(h[2 * i], h[2 * i + 1], lo_half);
        const v16f hb = __builtin_shuffle(h[2 * i], h[2 * i + 1], hi_half);
        l[i] = vmin16(la, lb);
        h[i] = vmax16(ha, hb);
    }
}

/* One group's g values folded into one vector of minima and one of maxima. */
INLINE void fold_group(const float *restrict xg, int64_t g, v16f *l, v16f *h) {
    v16f a = vload16(xg), b = a;
    for (int64_t i = 16; i < g; i += 16) {
        const v16f y = vload16(xg + i);
        a = vmin16(y, a);
        b = vmax16(y, b);
    }
    *l = a;
    *h = b;
}

INLINE void row_minmax(const float *restrict x, int64_t hd, int64_t g, float *restrict lo,
                       float *restrict hi) {
    const v16i f8 = {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7};
    const v16i f4 = {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11};
    const v16i f2 = {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13};
    const v16i f1 = {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14};
    /* the four steps' lane picks: each output lane takes one of two partners from (a, b) */
    const v16i s8a = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i s8b = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i s4a = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i s4b = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i s2a = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i s2b = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i s1a = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i s1b = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    const int64_t groups = hd / g;
    int64_t j = 0;
    for (; j + 16 <= groups; j += 16) {
        v16f l[16], h[16];
        for (int k = 0; k < 16; k++) fold_group(x + (j + k) * g, g, &l[k], &h[k]);
        minmax_step(l, h, 8, s8a, s8b);
        minmax_step(l, h, 4, s4a, s4b);
        minmax_step(l, h, 2, s2a, s2b);
        minmax_step(l, h, 1, s1a, s1b);
        vstore16(lo + j, l[0]);
        vstore16(hi + j, h[0]);
    }
    for (; j < groups; j++) {
        v16f l, h;
        fold_group(x + j * g, g, &l, &h);
        l = vmin16(l, __builtin_shuffle(l, f8));
        h = vmax16(h, __builtin_shuffle(h, f8));
        l = vmin16(l, __builtin_shuffle(l, f4));
        h = vmax16(h, __builtin_shuffle(h, f4));
        l = vmin16(l, __builtin_shuffle(l, f2));
        h = vmax16(h, __builtin_shuffle(h, f2));
        l = vmin16(l, __builtin_shuffle(l, f1));
        h = vmax16(h, __builtin_shuffle(h, f1));
        lo[j] = l[0];
        hi[j] = h[0];
    }
}

/* row_minmax for machines without 512-bit vectors: GCC 12 lowers a 16-lane compare-and-select
 * to a scalar compare and branch per lane there (x86-64-v3: 27 % of an exact encode's samples sat
 * in vmin16 / vmax16 on an AVX2 box), while 8 lanes map onto one AVX2 register. Each group is
 * folded into 8 lanes, then eight groups at a time reduced together in three steps (fold8 and
 * minmax_step's scheme at half the width), the rest one by one. Same results as row_minmax. */
INLINE v8f vmin8(v8f a, v8f b) { const v8i m = a < b; return (v8f)(((v8i)a & m) | ((v8i)b & ~m)); }
INLINE v8f vmax8(v8f a, v8f b) { const v8i m = a > b; return (v8f)(((v8i)a & m) | ((v8i)b & ~m)); }

INLINE void fold_group8(const float *restrict xg, int64_t g, v8f *l, v8f *h) {
    v8f a = vload(xg), b = a;
    for (int64_t i = 8; i < g; i += 8) {
        const v8f y = vload(xg + i);
        a = vmin8(y, a);
        b = vmax8(y, b);
    }
    *l = a;
    *h = b;
}

INLINE void minmax_step8(v8f *l, v8f *h, int n, const v8i lo_half, const v8i hi_half) {
    for (int i = 0; i < n; i++) {
        const v8f la = __builtin_shuffle(l[2 * i], l[2 * i + 1], lo_half);
        const v8f lb = __builtin_shuffle(l[2 * i], l[2 * i + 1], hi_half);
        const v8f ha = __builtin_shuffle(h[2 * i], h[2 * i + 1], lo_half);
        const v8f hb = __builtin_shuffle(h[2 * i], h[2 * i + 1], hi_half);
        l[i] = vmin8(la, lb);
        h[i] = vmax8(ha, hb);
    }
}

INLINE void row_minmax8(const float *restrict x, int64_t hd, int64_t g, float *restrict lo,
                        float *restrict hi) {
    const v8i f4 = {4, 5, 6, 7, 0, 1, 2, 3}, f2 = {2, 3, 0, 1, 6, 7, 4, 5};
    const v8i f1 = {1, 0, 3, 2, 5, 4, 7, 6};
    const v8i s4a = {0, 1, 2, 3, 8, 9, 10, 11}, s4b = {4, 5, 6, 7, 12, 13, 14, 15};
    const v8i s2a = {0, 1, 4, 5, 8, 9, 12, 13}, s2b = {2, 3, 6, 7, 10, 11, 14, 15};
    const v8i s1a = {0, 2, 4, 6, 8, 10, 12, 14}, s1b = {1, 3, 5, 7, 9, 11, 13, 15};
    const int64_t groups = hd / g;
    int64_t j = 0;
    for (; j + 8 <= groups; j += 8) {
        v8f l[8], h[8];
        for (int k = 0; k < 8; k++) fold_group8(x + (j + k) * g, g, &l[k], &h[k]);
        minmax_step8(l, h, 4, s4a, s4b);
        minmax_step8(l, h, 2, s2a, s2b);
        minmax_step8(l, h, 1, s1a, s1b);
        vstore(lo + j, l[0]);
        vstore(hi + j, h[0]);
    }
    for (; j < groups; j++) {
        v8f l, h;
        fold_group8(x + j * g, g, &l, &h);
        l = vmin8(l, __builtin_shuffle(l, f4));
        h = vmax8(h, __builtin_shuffle(h, f4));
        l = vmin8(l, __builtin_shuffle(l, f2));
        h = vmax8(h, __builtin_shuffle(h, f2));
        l = vmin8(l, __builtin_shuffle(l, f1));
        h = vmax8(h, __builtin_shuffle(h, f1));
        lo[j] = l[0];
        hi[j] = h[0];
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
    ptrs[np++] = W.S.blk = coding ? xalloc(num_blocks(chunk_values) * 2) : NULL;
    ptrs[np++] = W.S.records = coding ? xalloc(chunk_values * G.vb + 64) : NULL;
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
                if (t + PREFETCH_READ_AHEAD < n)
                    prefetch_row(pool_row(&G, pool, slots[t + PREFETCH_READ_AHEAD]), hd * G.vb, 0);
                bad |= load_row(&G, pool_row(&G, pool, slots[t]), x);
                if (G.rotate) row_transform(&G, x, 0);
                if (!G.over) {
                    if (G.wide16)
                        row_minmax(x, hd, G.g, W.lo, W.hi);
                    else
                        row_minmax8(x, hd, G.g, W.lo, W.hi);
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
