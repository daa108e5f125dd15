/* Loading pool rows as fp32 and storing fp32 back in the pool's dtype.
 * Part of lynx_codec.c's single translation unit (included there, in order). */
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
