/* The fused per-(layer, kind) codec runs in plain C (C11 + GCC extensions, no Python/torch headers).
 *
 * Owns the CPU implementation of lynx_kernels.fused: encode a run of KV pool rows into Anchor and
 * Residual wire chunks (header, payload, CRC-32), and apply landed chunks back into pool rows.
 * Called by lynx_kernels.ops_cpu through ctypes. It must be bit-identical to the torch reference
 * (lynx_kernels.codec, .wire, .exact, .rotation): every float step is the reference's IEEE fp32
 * operation in the reference's order; the build passes -ffp-contract=off and no fast-math, so the
 * compiler neither fuses a multiply-add nor reassociates a sum. Hot functions are compiled twice
 * (x86-64-v4, x86-64-v3 and baseline, chosen at load time) via target_clones.
 *
 * Assumes a little-endian host (the wire format is little endian and is read/written with memcpy).
 *
 * One translation unit, split by concept into the headers below (included in this order; every
 * function is static, so the compiler sees and inlines across all of them as before).
 */
#include "common.h"
#include "scalar.h"
#include "crc32.h"
#include "geometry.h"
#include "rotation.h"
#include "packing.h"
#include "quantize.h"
#include "values.h"
#include "exact_model.h"
#include "exact_encode.h"
#include "encode.h"
#include "apply_check.h"
#include "apply.h"
#include "exact_decode.h"

/* ---- exported ---- */

void lynx_init(void) {
    crc_init();
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_clmul = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
    have_vpclmul = have_clmul && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("vpclmulqdq");
#endif
}

/* Which clone the CPU gets ("x86-64-v4", "x86-64-v3" or "baseline"), for reports. */
const char *lynx_isa(void) {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
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
