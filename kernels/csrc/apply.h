/* Decoding validated chunks into pool rows.
 * Part of lynx_codec.c's single translation unit (included there, in order). */
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
        if (t + PREFETCH_WRITE_AHEAD < a->end)
            prefetch_row(pool_row(G, pool, slots[t + PREFETCH_WRITE_AHEAD]), rowb, 1);
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
