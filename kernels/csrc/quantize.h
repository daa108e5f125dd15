/* Group statistics and quantization to INT8 codes (lynx_kernels.codec, ops_torch.quantize_codes).
 * Part of lynx_codec.c's single translation unit (included there, in order). */
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
