/* The exact Residual's model: predictions, ordinals and classes of the corrections (lynx_kernels.exact).
 * Part of lynx_codec.c's single translation unit (included there, in order). */
/* ---- exact Residual: predictions, ordinals, classes (lynx_kernels.exact) ---- */

INLINE int32_t ord16(uint32_t b) { return (int32_t)(b & 0x7FFF) ^ -(int32_t)(b >> 15); }
INLINE int64_t ord32(uint32_t b) { return (int64_t)(b & 0x7FFFFFFFu) ^ -(int64_t)(b >> 31); }

INLINE int is_nan_bits(const geo_t *G, uint32_t bits) {
    if (G->vb == 4) return (bits & 0x7FFFFFFFu) > 0x7F800000u;
    if (G->p->dtype == DT_F16) return (bits & 0x7FFFu) > 0x7C00u;
    return (bits & 0x7FFFu) > 0x7F80u;
}

INLINE int bitlen(uint64_t v) { return v ? 64 - __builtin_clzll(v) : 0; }

/* How many L fields (k <= k_base + 15 bits each) fit in one 56-bit word: the coders move them
 * in such groups. */
INLINE int l_group(const geo_t *G) {
    const int kmax = G->p->k_base + 15;
    return 3 * kmax <= 56 ? 3 : (2 * kmax <= 56 ? 2 : 1);
}

/* The k of class c from the k table packed as 16 nibbles (klo: classes 0-7, khi: 8-15): a shift,
 * not a table load, so the loops that call it vectorize. */
INLINE uint32_t k_of_class(uint32_t c, uint32_t klo, uint32_t khi, uint32_t k_base) {
    return ((c < 8 ? klo >> (4 * c) : khi >> (4 * (c - 8))) & 15) + k_base;
}

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
            /* from j = 0, not 1: D - 1 values left a 31-value scalar tail after the vector part
             * (8-11 % of the exact encode's and decode's row work) */
            for (int64_t j = 0; j < D; j++) m = eh[j] > m ? eh[j] : m;
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
