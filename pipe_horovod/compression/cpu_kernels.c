/* One fused pass per stage of the two-stage int8 reduction on CPU tensors.
 *
 * compression/two_stage.py holds the math as torch operations, each one pass over
 * memory (about 2.3 ns per gradient byte in all on one core, where the 1 Gbit wire
 * needs about 2 ns per byte for the int8 bytes). These loops do the same operations
 * block by block, each block in L1, and must give the same bits:
 *
 *   scale = amax / 127 (in the accumulator's type, then float32), divisor = scale
 *   where scale > 0 else 1, q = v / divisor clamped to +-127 and rounded half to
 *   even, decoded = q * scale.
 *
 * Every operation is one IEEE operation in the same type and order as torch's, so
 * the build must keep IEEE semantics (native.py: -fno-fast-math -ffp-contract=off, no
 * FMA contraction, no -march=native; -fno-trapping-math only lets the clamps be
 * vectorized as selects, as no FP trap is ever enabled). The rounding is the classic
 * (q + 1.5 * 2^23) - 1.5 * 2^23, exact round-half-even for |q| <= 127 in the default
 * rounding mode and vectorizable on plain SSE2 (nearbyintf is not), with the sign
 * put back so that -0.3 gives -0 as torch.round does.
 *
 * A block whose amax or scale is not finite (NaN, inf, or a float64 scale beyond
 * float32) is not handled here: the functions stop at it and return its index, and
 * the caller finishes from that block on in torch (what torch makes of NaN in an
 * int8 cast depends on its vector width). Blocks before it are complete. Return
 * value: number of blocks done, equal to the block count on success; -1 on an
 * allocation failure (nothing written).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define ABI_VERSION 1

int phv_abi_version(void) { return ABI_VERSION; }

static inline float round_even_f32(float q)
{
    float r = (q + 12582912.0f) - 12582912.0f;        /* 1.5 * 2^23 */
    return copysignf(r, q);
}

static inline double round_even_f64(double q)
{
    double r = (q + 6755399441055744.0) - 6755399441055744.0;   /* 1.5 * 2^52 */
    return copysign(r, q);
}

/* max |v| as bits: for sign-cleared IEEE values the unsigned order of the bits is
   the numeric order, and NaN sorts above inf, so one integer max finds both (and
   vectorizes, where a float max reduction may not without -ffast-math). */
#define ABS_BITS_f32(v, out) do { uint32_t u_; memcpy(&u_, &(v), 4); (out) = u_ & 0x7fffffffu; } while (0)
#define ABS_BITS_f64(v, out) do { uint64_t u_; memcpy(&u_, &(v), 8); (out) = u_ & 0x7fffffffffffffffull; } while (0)

/* T: element type; UT: its bits; S: suffix; INF: bits of +inf. */
#define DEFINE_KERNELS(T, UT, S, INF)                                                   \
                                                                                        \
/* One block: v = x (+ add); writes the scale, the int8 values and, where asked,     \
   back = decoded and res = v - decoded (res may alias add). 0: done; 1: not finite. */ \
static inline int block_##S(const T *x, const T *add, T *res, T *back, int64_t m,      \
                            float *scale_out, int8_t *vals)                            \
{                                                                                       \
    UT mx = 0;                                                                          \
    if (add) {                                                                          \
        for (int64_t i = 0; i < m; i++) {                                               \
            T v = x[i] + add[i]; UT a; ABS_BITS_##S(v, a); mx = a > mx ? a : mx;        \
        }                                                                               \
    } else {                                                                            \
        for (int64_t i = 0; i < m; i++) {                                               \
            UT a; ABS_BITS_##S(x[i], a); mx = a > mx ? a : mx;                          \
        }                                                                               \
    }                                                                                   \
    if (mx >= (UT)(INF)) return 1;                                                      \
    T amax; memcpy(&amax, &mx, sizeof(T));                                              \
    float scale = (float)(amax / (T)127);                                               \
    if (!isfinite(scale)) return 1;                                                     \
    T sc = (T)scale;                                                                    \
    T div = scale > 0.0f ? sc : (T)1;                                                   \
    *scale_out = scale;                                                                 \
    for (int64_t i = 0; i < m; i++) {                                                   \
        T v = add ? x[i] + add[i] : x[i];                                               \
        T q = v / div;                                                                  \
        q = q < (T)-127 ? (T)-127 : q;                                                  \
        q = q > (T)127 ? (T)127 : q;                                                    \
        T r = round_even_##S(q);                                                        \
        vals[i] = (int8_t)r;                                                            \
        T d = r * sc;                                                                   \
        if (back) back[i] = d;                                                          \
        if (res) res[i] = v - d;                                                        \
    }                                                                                   \
    return 0;                                                                           \
}                                                                                       \
                                                                                        \
/* Specialized copies, so that each inner loop has no tests left in it. */             \
static int block_plain_##S(const T *x, int64_t m, float *s, int8_t *q, T *back)       \
{ return block_##S(x, NULL, NULL, back, m, s, q); }                                     \
static int block_quiet_##S(const T *x, int64_t m, float *s, int8_t *q)                 \
{ return block_##S(x, NULL, NULL, NULL, m, s, q); }                                     \
static int block_res_##S(const T *x, T *res, int64_t m, float *s, int8_t *q)           \
{ return block_##S(x, NULL, res, NULL, m, s, q); }                                      \
static int block_feed_##S(const T *x, T *res, int64_t m, float *s, int8_t *q)          \
{ return block_##S(x, res, res, NULL, m, s, q); }                                       \
                                                                                        \
/* quantize: x (+ res, then res = what was lost) into scales and values; back      \
   (decoded) where not NULL. With res, back must be NULL. */                            \
int64_t phv_encode_##S(const T *x, T *res, T *back, int64_t n, int64_t bs,             \
                       float *scales, int8_t *vals)                                     \
{                                                                                       \
    int64_t nb = (n + bs - 1) / bs;                                                     \
    for (int64_t b = 0; b < nb; b++) {                                                  \
        int64_t lo = b * bs, m = n - lo < bs ? n - lo : bs;                             \
        int bad = res ? block_feed_##S(x + lo, res + lo, m, scales + b, vals + lo)      \
                : back ? block_plain_##S(x + lo, m, scales + b, vals + lo, back + lo)   \
                : block_quiet_##S(x + lo, m, scales + b, vals + lo);                    \
        if (bad) return b;                                                              \
    }                                                                                   \
    return nb;                                                                          \
}                                                                                       \
                                                                                        \
/* dequantize into out; stops at a block whose scale is not finite. */                  \
int64_t phv_decode_##S(const float *scales, const int8_t *vals, int64_t n, int64_t bs,  \
                       T *out)                                                          \
{                                                                                       \
    int64_t nb = (n + bs - 1) / bs;                                                     \
    for (int64_t b = 0; b < nb; b++) {                                                  \
        int64_t lo = b * bs, m = n - lo < bs ? n - lo : bs;                             \
        if (!isfinite(scales[b])) return b;                                             \
        T sc = (T)scales[b];                                                            \
        for (int64_t i = 0; i < m; i++) out[lo + i] = (T)vals[lo + i] * sc;             \
    }                                                                                   \
    return nb;                                                                          \
}                                                                                       \
                                                                                        \
/* Stage 2: `size` wires of n elements, `stride` bytes apart, dequantized (times      \
   pre if has_pre), summed in rank order, / size if average, times post if has_post,  \
   + res if res; then quantized into scales/vals, res = what that lost. */              \
int64_t phv_reduce_##S(const uint8_t *recv, int64_t stride, int64_t size, int64_t n,    \
                       int64_t bs, double pre_d, int has_pre, int average,              \
                       double post_d, int has_post, T *res, float *scales,              \
                       int8_t *vals)                                                    \
{                                                                                       \
    int64_t nb = (n + bs - 1) / bs;                                                     \
    T pre = (T)pre_d, post = (T)post_d, count = (T)size;                                \
    T *t = (T *)malloc(sizeof(T) * (size_t)(bs > 0 ? bs : 1));                          \
    if (!t) return -1;                                                                  \
    for (int64_t b = 0; b < nb; b++) {                                                  \
        int64_t lo = b * bs, m = n - lo < bs ? n - lo : bs;                             \
        for (int64_t r = 0; r < size; r++) {                                            \
            const uint8_t *w = recv + r * stride;                                       \
            float s; memcpy(&s, w + 4 * b, 4);                                          \
            T sc = (T)s;                                                                \
            const int8_t *q = (const int8_t *)(w + 4 * nb) + lo;                        \
            if (r == 0) {                                                               \
                if (has_pre) for (int64_t i = 0; i < m; i++) t[i] = ((T)q[i] * sc) * pre; \
                else for (int64_t i = 0; i < m; i++) t[i] = (T)q[i] * sc;               \
            } else {                                                                    \
                if (has_pre) for (int64_t i = 0; i < m; i++) t[i] = t[i] + ((T)q[i] * sc) * pre; \
                else for (int64_t i = 0; i < m; i++) t[i] = t[i] + (T)q[i] * sc;        \
            }                                                                           \
        }                                                                               \
        if (average) for (int64_t i = 0; i < m; i++) t[i] = t[i] / count;               \
        if (has_post) for (int64_t i = 0; i < m; i++) t[i] = t[i] * post;               \
        int bad;                                                                        \
        if (res) {                                                                      \
            T *rb = res + lo;                                                           \
            for (int64_t i = 0; i < m; i++) t[i] = t[i] + rb[i];                        \
            bad = block_res_##S(t, rb, m, scales + b, vals + lo);                       \
        } else {                                                                        \
            bad = block_quiet_##S(t, m, scales + b, vals + lo);                         \
        }                                                                               \
        if (bad) { free(t); return b; }                                                 \
    }                                                                                   \
    free(t);                                                                            \
    return nb;                                                                          \
}

DEFINE_KERNELS(float, uint32_t, f32, 0x7f800000u)
DEFINE_KERNELS(double, uint64_t, f64, 0x7ff0000000000000ull)
