/* FP8 block quantization and decoding for the CPU emulation, one pass each (infir2.kernels.native).
 *
 * Bit-identical to infir2.fp8.quantize (the reference) for fp32 input (a partial edge block is
 * what the reference's zero padding makes of it: the padding changes no amax and is cut off):
 *   amax  = max |x| per block                  (exact: a max of magnitudes, taken on their bits)
 *   scale = fmax / amax, clamped to FLT_MAX; 1 where amax == 0; pow2: mantissa cleared
 *   y     = clamp(x * scale, -fmax, fmax)      (one IEEE multiply, as torch does)
 *   q     = y rounded to the FP8 grid, to nearest, ties to even, in fp32:
 *           magic = 2^(E + 23 - mbits), E = max(exponent of |y|, the smallest normal's);
 *           (|y| + magic) - magic is exact and rounds at the grid's spacing (see fast_emulated)
 *   deq   = q * scale_inv, scale_inv = 1 / scale (IEEE division, as torch's reciprocal)
 *   code  = the FP8 byte of q (exact: q is on the grid)
 * Build flags keep IEEE semantics: no -ffast-math, -ffp-contract=off (no fused multiply-add).
 * A block whose amax is NaN or inf makes quantize return 1 before writing anything: the caller
 * then runs the reference, which defines those bytes.
 */
#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float float_of(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

#define ABS_MASK 0x7FFFFFFFu
#define SIGN_BIT 0x80000000u
#define EXPONENT_FIELD 0x7F800000u
#define INF_BITS 0x7F800000u
#define FLT_MAX_BITS 0x7F7FFFFFu
#define EXPONENT_AND_SIGN 0xFF800000u
#define LANES 16

/* amax[Mb*Kb] (as magnitude bits) of x[M,K] with bm x bk blocks; returns 1 if any is NaN/inf. */
static int block_amax(const float *x, int64_t M, int64_t K, int64_t bm, int64_t bk, uint32_t *amax) {
    const uint32_t *u = (const uint32_t *)x;
    int64_t Kb = (K + bk - 1) / bk, nblocks = ((M + bm - 1) / bm) * Kb;
    memset(amax, 0, sizeof(uint32_t) * (size_t)nblocks);
    for (int64_t i = 0; i < M; i++) {
        const uint32_t *row = u + i * K;
        uint32_t *m = amax + (i / bm) * Kb;
        if (bk == 1) {  /* one column per block: an element-wise max into the block row */
            for (int64_t k = 0; k < K; k++) {
                uint32_t a = row[k] & ABS_MASK;
                m[k] = a > m[k] ? a : m[k];
            }
            continue;
        }
        for (int64_t kb = 0; kb < Kb; kb++) {
            const uint32_t *p = row + kb * bk;
            int64_t n = kb == Kb - 1 ? K - kb * bk : bk;  /* a partial last block: its zero padding
                                                              would not change the amax */
            uint32_t lane[LANES] = {0};
            int64_t j = 0;
            for (; j + LANES <= n; j += LANES)
                for (int l = 0; l < LANES; l++) {
                    uint32_t a = p[j + l] & ABS_MASK;
                    lane[l] = a > lane[l] ? a : lane[l];
                }
            uint32_t r = m[kb];
            for (; j < n; j++) { uint32_t a = p[j] & ABS_MASK; r = a > r ? a : r; }
            for (int l = 0; l < LANES; l++) r = lane[l] > r ? lane[l] : r;
            m[kb] = r;
        }
    }
    int bad = 0;
    for (int64_t b = 0; b < nblocks; b++) bad |= amax[b] >= INF_BITS;
    return bad;
}

/* The constants of one FP8 format's grid (from fast_emulated's _Grid). */
typedef struct {
    uint32_t fmax_bits;       /* the largest finite value's bits */
    uint32_t exponent_floor;  /* bits of the smallest normal, 2^emin */
    uint32_t magic_offset;    /* (23 - mbits) << 23 */
    uint32_t rebias;          /* (127 - bias) << mbits */
    int shift;                /* 23 - mbits */
    float subnormal_factor;   /* 2^(mbits - emin): a subnormal's mantissa as an integer */
} grid_t;

/* One element: y = clamp(x * s), rounded to the grid; writes deq = q * inv and its code. */
static inline void round_one(float xv, float s, float inv, const grid_t *g, float *deq, uint8_t *code) {
    uint32_t y = bits_of(xv * s);
    uint32_t sign = y & SIGN_BIT;
    uint32_t magnitude = y & ABS_MASK;
    magnitude = magnitude > g->fmax_bits ? g->fmax_bits : magnitude;  /* saturate: an integer min of
                                                   magnitudes is the float min (y is finite) */
    float ay = float_of(magnitude);
    uint32_t e = magnitude & EXPONENT_FIELD;
    e = e < g->exponent_floor ? g->exponent_floor : e;
    float magic = float_of(e + g->magic_offset);
    float aq = (ay + magic) - magic;
    *deq = float_of(bits_of(aq) | sign) * inv;
    uint32_t q = bits_of(aq);
    int32_t normal = (int32_t)(q >> g->shift) - (int32_t)g->rebias;
    /* a subnormal's mantissa as an integer; converted for every element (branch-free), so the
       normal ones are zeroed first: their products could overflow an int32 */
    uint32_t is_normal = 0u - (uint32_t)(q >= g->exponent_floor);  /* all ones or zero: branch-free */
    int32_t subnormal = (int32_t)(float_of(q & ~is_normal) * g->subnormal_factor);
    uint32_t mag = ((uint32_t)normal & is_normal) | ((uint32_t)subnormal & ~is_normal);
    *code = (uint8_t)(mag | (sign >> 24));
}

/* n elements sharing one scale (a 1 x bk or bm x bk block's row segment). */
static void round_segment(const float *x, int64_t n, float s, float inv, const grid_t *g, float *deq,
                          uint8_t *codes) {
    for (int64_t k = 0; k < n; k++) round_one(x[k], s, inv, g, deq + k, codes + k);
}

/* n elements with a scale each (bm x 1 blocks: one scale per column). */
static void round_columns(const float *x, int64_t n, const float *s, const float *inv, const grid_t *g,
                          float *deq, uint8_t *codes) {
    for (int64_t k = 0; k < n; k++) round_one(x[k], s[k], inv[k], g, deq + k, codes + k);
}

/* x [M,K] fp32 -> scale_inv [Mb,Kb], codes [M,K], deq [M,K]; scale [Mb,Kb] is scratch. 0 on success. */
int infir2_quantize(const float *x, int64_t M, int64_t K, int64_t bm, int64_t bk, float fmax, int pow2,
                    uint32_t exponent_floor, uint32_t magic_offset, int mbits, int exp_bias,
                    float *scale_inv, float *scale, uint8_t *codes, float *deq) {
    int64_t Kb = (K + bk - 1) / bk, nblocks = ((M + bm - 1) / bm) * Kb;
    uint32_t *amax = (uint32_t *)scale;  /* amax bits first, the scale in place after */
    if (block_amax(x, M, K, bm, bk, amax)) return 1;
    for (int64_t b = 0; b < nblocks; b++) {
        float a = float_of(amax[b]);
        float s = fmax / a;  /* inf when a is 0 or fmax / a overflows */
        if (bits_of(s) > FLT_MAX_BITS) s = float_of(FLT_MAX_BITS);
        if (a == 0.0f) s = 1.0f;
        if (pow2) s = float_of(bits_of(s) & EXPONENT_AND_SIGN);
        scale[b] = s;
        scale_inv[b] = 1.0f / s;
    }
    grid_t g = {bits_of(fmax), exponent_floor, magic_offset, (uint32_t)(127 - exp_bias) << mbits, 23 - mbits,
                float_of((uint32_t)(127 + mbits + exp_bias - 1) << 23)};
    for (int64_t i = 0; i < M; i++) {
        const float *row = x + i * K;
        const float *srow = scale + (i / bm) * Kb, *irow = scale_inv + (i / bm) * Kb;
        if (bk == 1) {
            round_columns(row, K, srow, irow, &g, deq + i * K, codes + i * K);
            continue;
        }
        for (int64_t kb = 0; kb < Kb; kb++)
            round_segment(row + kb * bk, kb == Kb - 1 ? K - kb * bk : bk, srow[kb], irow[kb], &g,
                          deq + i * K + kb * bk, codes + i * K + kb * bk);
    }
    return 0;
}

/* codes [M,K] (finite FP8 bytes) * scale_inv [Mb,Kb] -> out [M,K] fp32. Returns 1 (nothing
 * written) if a code is NaN/inf: the caller runs the reference. */
int infir2_decode(const uint8_t *codes, int64_t M, int64_t K, int64_t bm, int64_t bk, const float *scale_inv,
                  int shift, uint32_t decode_mask, float decode_factor, uint32_t magnitude,
                  uint32_t nonfinite_magnitude, float *out) {
    int64_t n = M * K, Kb = (K + bk - 1) / bk;
    uint8_t worst = 0;
    for (int64_t t = 0; t < n; t++) { uint8_t c = codes[t] & magnitude; worst = c > worst ? c : worst; }
    if (worst >= nonfinite_magnitude) return 1;
    for (int64_t i = 0; i < M; i++) {
        const uint8_t *crow = codes + i * K;
        const float *srow = scale_inv + (i / bm) * Kb;
        float *orow = out + i * K;
        if (bk == 1) {
            for (int64_t k = 0; k < K; k++)
                orow[k] = (float_of(((uint32_t)(int32_t)(int8_t)crow[k] << shift) & decode_mask) * decode_factor) * srow[k];
            continue;
        }
        for (int64_t kb = 0; kb < Kb; kb++) {
            float s = srow[kb];
            for (int64_t k = kb * bk, end = kb == Kb - 1 ? K : (kb + 1) * bk; k < end; k++)
                orow[k] = (float_of(((uint32_t)(int32_t)(int8_t)crow[k] << shift) & decode_mask) * decode_factor) * s;
        }
    }
    return 0;
}
