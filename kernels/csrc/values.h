/* Loading pool rows as fp32 and storing fp32 back in the pool's dtype.
 * Part of lynx_codec.c's single translation unit (included there, in order). */
/* ---- values in and out of the pool dtype ---- */

/* A pool row as fp32. Returns 1 if the reference refuses it: a NaN (target exact) or any
 * non-finite value (int8). Exact: values with |x| >= limit (Inf included) become 0 (they reach the
 * decode through the correction's escapes). */
/* One value of a loaded row through the reference's check (see load_row). */
INLINE float checked_value(float f, int exact, float lim, int *bad) {
    if (!exact) {
        *bad |= !(__builtin_fabsf(f) <= 3.402823466e38f);
        return f;
    }
    *bad |= f != f;
    return __builtin_fabsf(f) >= lim ? 0.0f : f;
}

/* The conversion and the check in one pass over the row, while each value is in a register. */
#define LOAD_CHECKED(convert)                                                                       \
    do {                                                                                            \
        if (exact)                                                                                  \
            for (int64_t i = 0; i < hd; i++) x[i] = checked_value(convert, 1, lim, &bad);           \
        else                                                                                        \
            for (int64_t i = 0; i < hd; i++) x[i] = checked_value(convert, 0, lim, &bad);           \
    } while (0)

INLINE int load_row(const geo_t *G, const uint8_t *restrict src, float *restrict x) {
    const int64_t hd = G->hd;
    const int exact = G->exact;
    const float lim = G->p->limit;
    int bad = 0;
    switch (G->p->dtype) {
        case DT_F32: LOAD_CHECKED(bits_f32(get32(src + 4 * i))); break;
        case DT_F16: LOAD_CHECKED(h2f(get16(src + 2 * i))); break;
        default: LOAD_CHECKED(bits_f32((uint32_t)get16(src + 2 * i) << 16));
    }
    return bad;
}
#undef LOAD_CHECKED

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
