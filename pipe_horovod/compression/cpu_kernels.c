/* One fused pass per stage of the two-stage int8 / int4 / fp8 reduction on CPU tensors.
 *
 * compression/two_stage.py holds the math as torch operations, each one pass over
 * memory (about 2.3 ns per gradient byte in all on one core, where the 1 Gbit wire
 * needs about 2 ns per byte for the int8 bytes). These loops do the same operations
 * block by block, each block in L1, and must give the same bits:
 *
 *   scale = amax / qmax (in the accumulator's type, then float32), divisor = scale
 *   where scale > 0 else 1, q = v / divisor clamped to +-qmax, then for int8
 *   (kind 0, qmax 127) and int4 (kind 3, qmax 7) rounded half to even, for float8
 *   (kind 1 e4m3fn, 2 e5m2) cast to float32 and to the 8-bit type as c10 does it
 *   (fp8_round below); decoded = q * scale. Receivers decode float8 bytes through
 *   torch's own table of the 256 values (`table`). int4 packs two values a byte
 *   (element 2k in the low four bits of byte k, two's complement; blocks have an even
 *   size, so block b's values start at byte b * bs / 2).
 *
 * Every operation is one IEEE operation in the same type and order as torch's, so
 * the build must keep IEEE semantics (native.py: -fno-fast-math -ffp-contract=off, no
 * FMA contraction, no -march=native but an AVX2 copy chosen at load time, CLONES
 * below; -fno-trapping-math only lets the clamps be vectorized as selects, as no FP
 * trap is ever enabled). The rounding is the classic
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

#define ABI_VERSION 3

/* Where a block's values start, for an element offset `lo` (even for int4). */
#define VOFF(kind, lo) ((kind) == 3 ? (lo) / 2 : (lo))

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

static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float f32_from(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> float8 (kind 1 e4m3fn, 2 e5m2) as c10 does it
   (torch/headeronly/util/Float8_e4m3fn.h, Float8_e5m2.h: round half to even, the
   denormals by adding a power of two), for |f| <= the format's largest finite value
   (the callers clamp), without branches so that it vectorizes; returns the float8
   value as a float32 (torch's decoding of the byte). Checked exhaustively: every
   float32 of either sign in range gives torch's byte and value (docs/compression.md). */
static inline float fp8_round(float f, int kind, uint8_t *byte)
{
    const int shift = kind == 1 ? 20 : 21;                 /* mantissa bits dropped */
    const uint32_t small = kind == 1 ? 121u << 23 : 113u << 23;   /* smallest normal */
    const uint32_t magic = kind == 1 ? 141u << 23 : 134u << 23;   /* denormal rounding */
    const uint32_t bias = kind == 1 ? 120u << 3 : 112u << 2;      /* exponent rebias */
    uint32_t bits = f32_bits(f), sign = bits & 0x80000000u;
    bits ^= sign;
    uint32_t dbits = f32_bits(f32_from(bits) + f32_from(magic));
    float dval = f32_from(dbits) - f32_from(magic);
    uint32_t nbits = bits + ((1u << (shift - 1)) - 1) + ((bits >> shift) & 1);
    int tiny = bits < small;
    *byte = (uint8_t)((tiny ? dbits - magic : (nbits >> shift) - bias) | (sign >> 24));
    return f32_from(f32_bits(tiny ? dval : f32_from(nbits & ~((1u << shift) - 1))) | sign);
}

#define INLINE static inline __attribute__((always_inline))

/* int4 runs int8's loops on pieces of PIECE values (even: a piece starts on a byte),
   packed or unpacked apart: loops with no pair logic left in them vectorize. */
#define PIECE 256

/* Two's complement nibbles: q[2k] into the low four bits of byte k, q[2k+1] into the
   high four; an odd count's last byte has zero high bits. */
INLINE void pack4(uint8_t *out, const int8_t *q, int64_t n)
{
    for (int64_t k = 0; k < n / 2; k++)
        out[k] = (uint8_t)((q[2 * k] & 0x0F) | ((q[2 * k + 1] & 0x0F) << 4));
    if (n & 1) out[n / 2] = (uint8_t)(q[n - 1] & 0x0F);
}

INLINE void unpack4(int8_t *q, const uint8_t *in, int64_t n)
{
    for (int64_t k = 0; k < n / 2; k++) {
        int8_t b = (int8_t)in[k];
        q[2 * k] = (int8_t)((int8_t)(b << 4) >> 4);
        q[2 * k + 1] = (int8_t)(b >> 4);
    }
    if (n & 1) q[n - 1] = (int8_t)((int8_t)(in[n / 2] << 4) >> 4);
}

/* x86-64: each exported function also in an AVX2 copy, chosen at load time from the
   CPU's features (so a cache shared by machines stays valid). The same IEEE
   operations, wider; -ffp-contract=off keeps FMA out. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(PHV_NO_CLONES)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* T: element type; UT: its bits; S: suffix; INF: bits of +inf. */
#define DEFINE_KERNELS(T, UT, S, INF)                                                   \
                                                                                        \
/* One block: v = x (+ add); writes the scale, the 8-bit values and, where asked,    \
   back = decoded and res = v - decoded (res may alias add). 0: done; 1: not finite. \
   Always inlined with constant kind and NULLs, so each loop has no tests left. */      \
INLINE int block_##S(const T *x, const T *add, T *res, T *back, int64_t m,             \
                     float *scale_out, int8_t *vals, int kind, T qmax,                  \
                     const float *table)                                                \
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
    float scale = (float)(amax / qmax);                                                 \
    if (!isfinite(scale)) return 1;                                                     \
    T sc = (T)scale;                                                                    \
    T div = scale > 0.0f ? sc : (T)1;                                                   \
    *scale_out = scale;                                                                 \
    if (kind == 3) {   /* int4: int8's loop on a piece into q4, then two values a byte */ \
        uint8_t *pv = (uint8_t *)vals;                                                  \
        int8_t q4[PIECE];                                                               \
        for (int64_t lo = 0; lo < m; lo += PIECE) {                                     \
            int64_t n = m - lo < PIECE ? m - lo : PIECE;                                \
            for (int64_t i = lo; i < lo + n; i++) {                                     \
                T v = add ? x[i] + add[i] : x[i];                                       \
                T q = v / div;                                                          \
                q = q < -qmax ? -qmax : q;                                              \
                q = q > qmax ? qmax : q;                                                \
                T r = round_even_##S(q);                                                \
                q4[i - lo] = (int8_t)r;                                                 \
                T d = r * sc;                                                           \
                if (back) back[i] = d;                                                  \
                if (res) res[i] = v - d;                                                \
            }                                                                           \
            pack4(pv + lo / 2, q4, n);                                                  \
        }                                                                               \
        return 0;                                                                       \
    }                                                                                   \
    for (int64_t i = 0; i < m; i++) {                                                   \
        T v = add ? x[i] + add[i] : x[i];                                               \
        T q = v / div;                                                                  \
        q = q < -qmax ? -qmax : q;                                                      \
        q = q > qmax ? qmax : q;                                                        \
        T r;                                                                            \
        if (kind == 0) {                                                                \
            r = round_even_##S(q);                                                      \
            vals[i] = (int8_t)r;                                                        \
        } else {                                                                        \
            uint8_t b;                                                                  \
            r = (T)fp8_round((float)q, kind, &b);                                       \
            ((uint8_t *)vals)[i] = b;                                                   \
        }                                                                               \
        T d = r * sc;                                                                   \
        if (back) back[i] = d;                                                          \
        if (res) res[i] = v - d;                                                        \
    }                                                                                   \
    return 0;                                                                           \
}                                                                                       \
                                                                                        \
INLINE int64_t encode_##S(const T *x, T *res, T *back, int64_t n, int64_t bs,          \
                          float *scales, int8_t *vals, int kind, T qmax,                \
                          const float *table)                                           \
{                                                                                       \
    int64_t nb = (n + bs - 1) / bs;                                                     \
    for (int64_t b = 0; b < nb; b++) {                                                  \
        int64_t lo = b * bs, m = n - lo < bs ? n - lo : bs;                             \
        if (block_##S(x + lo, res ? res + lo : NULL, res ? res + lo : NULL,             \
                      back ? back + lo : NULL, m, scales + b, vals + VOFF(kind, lo),    \
                      kind, qmax, table))                                               \
            return b;                                                                   \
    }                                                                                   \
    return nb;                                                                          \
}                                                                                       \
                                                                                        \
/* quantize: x (+ res, then res = what was lost) into scales and values; back      \
   (decoded) where not NULL. With res, back must be NULL. */                            \
CLONES int64_t phv_encode_##S(const T *x, T *res, T *back, int64_t n, int64_t bs,             \
                       float *scales, int8_t *vals, int kind, double qmax_d,            \
                       const float *table)                                              \
{                                                                                       \
    T qmax = (T)qmax_d;                                                                 \
    if (kind == 0) {                                                                    \
        if (res) return encode_##S(x, res, NULL, n, bs, scales, vals, 0, qmax, table);  \
        if (back) return encode_##S(x, NULL, back, n, bs, scales, vals, 0, qmax, table);\
        return encode_##S(x, NULL, NULL, n, bs, scales, vals, 0, qmax, table);          \
    }                                                                                   \
    if (kind == 1) {                                                                    \
        if (res) return encode_##S(x, res, NULL, n, bs, scales, vals, 1, qmax, table);  \
        if (back) return encode_##S(x, NULL, back, n, bs, scales, vals, 1, qmax, table);\
        return encode_##S(x, NULL, NULL, n, bs, scales, vals, 1, qmax, table);          \
    }                                                                                   \
    if (kind == 3) {                                                                    \
        if (res) return encode_##S(x, res, NULL, n, bs, scales, vals, 3, qmax, table);  \
        if (back) return encode_##S(x, NULL, back, n, bs, scales, vals, 3, qmax, table);\
        return encode_##S(x, NULL, NULL, n, bs, scales, vals, 3, qmax, table);          \
    }                                                                                   \
    if (res) return encode_##S(x, res, NULL, n, bs, scales, vals, 2, qmax, table);      \
    if (back) return encode_##S(x, NULL, back, n, bs, scales, vals, 2, qmax, table);    \
    return encode_##S(x, NULL, NULL, n, bs, scales, vals, 2, qmax, table);              \
}                                                                                       \
                                                                                        \
/* int4's load: a piece's nibbles unpacked into int8 (unpack4), then int8's loop. */   \
INLINE void load4_##S(T *t, const int8_t *q, int64_t m, T sc, int first, int has_pre,   \
                      T pre)                                                            \
{                                                                                       \
    int8_t q4[PIECE];                                                                   \
    for (int64_t lo = 0; lo < m; lo += PIECE) {                                         \
        int64_t n = m - lo < PIECE ? m - lo : PIECE;                                    \
        unpack4(q4, (const uint8_t *)q + lo / 2, n);                                    \
        for (int64_t i = 0; i < n; i++) {                                               \
            T v = (T)q4[i] * sc;                                                        \
            if (has_pre) v = v * pre;                                                   \
            t[lo + i] = first ? v : t[lo + i] + v;                                      \
        }                                                                               \
    }                                                                                   \
}                                                                                       \
                                                                                        \
/* dequantize into out; stops at a block whose scale is not finite. */                  \
CLONES int64_t phv_decode_##S(const float *scales, const int8_t *vals, int64_t n, int64_t bs,  \
                       T *out, int kind, const float *table)                            \
{                                                                                       \
    int64_t nb = (n + bs - 1) / bs;                                                     \
    for (int64_t b = 0; b < nb; b++) {                                                  \
        int64_t lo = b * bs, m = n - lo < bs ? n - lo : bs;                             \
        if (!isfinite(scales[b])) return b;                                             \
        T sc = (T)scales[b];                                                            \
        if (kind == 0)                                                                  \
            for (int64_t i = 0; i < m; i++) out[lo + i] = (T)vals[lo + i] * sc;         \
        else if (kind == 3)                                                             \
            load4_##S(out + lo, vals + lo / 2, m, sc, 1, 0, (T)1);                      \
        else                                                                            \
            for (int64_t i = 0; i < m; i++)                                             \
                out[lo + i] = (T)table[((const uint8_t *)vals)[lo + i]] * sc;           \
    }                                                                                   \
    return nb;                                                                          \
}                                                                                       \
                                                                                        \
INLINE void load_##S(T *t, const int8_t *q, int64_t m, T sc, int first, int has_pre,    \
                     T pre, int kind, const float *table)                               \
{                                                                                       \
    for (int64_t i = 0; i < m; i++) {                                                   \
        T v = (kind == 0 ? (T)q[i] : (T)table[((const uint8_t *)q)[i]]) * sc;           \
        if (has_pre) v = v * pre;                                                       \
        t[i] = first ? v : t[i] + v;                                                    \
    }                                                                                   \
}                                                                                       \
                                                                                        \
/* Stage 2: `size` wires of n elements, `stride` bytes apart, dequantized (times      \
   pre if has_pre), summed in rank order, / size if average, times post if has_post,  \
   + res if res; then quantized into scales/vals, res = what that lost. */              \
CLONES int64_t phv_reduce_##S(const uint8_t *recv, int64_t stride, int64_t size, int64_t n,    \
                       int64_t bs, double pre_d, int has_pre, int average,              \
                       double post_d, int has_post, T *res, float *scales,              \
                       int8_t *vals, int kind, double qmax_d, const float *table)       \
{                                                                                       \
    int64_t nb = (n + bs - 1) / bs;                                                     \
    T pre = (T)pre_d, post = (T)post_d, count = (T)size, qmax = (T)qmax_d;              \
    T *t = (T *)malloc(sizeof(T) * (size_t)(bs > 0 ? bs : 1));                          \
    if (!t) return -1;                                                                  \
    for (int64_t b = 0; b < nb; b++) {                                                  \
        int64_t lo = b * bs, m = n - lo < bs ? n - lo : bs;                             \
        for (int64_t r = 0; r < size; r++) {                                            \
            const uint8_t *w = recv + r * stride;                                       \
            float s; memcpy(&s, w + 4 * b, 4);                                          \
            const int8_t *q = (const int8_t *)(w + 4 * nb) + VOFF(kind, lo);            \
            if (kind == 0 && has_pre && r == 0) load_##S(t, q, m, s, 1, 1, pre, 0, table); \
            else if (kind == 0 && has_pre) load_##S(t, q, m, s, 0, 1, pre, 0, table);   \
            else if (kind == 0 && r == 0) load_##S(t, q, m, s, 1, 0, pre, 0, table);    \
            else if (kind == 0) load_##S(t, q, m, s, 0, 0, pre, 0, table);              \
            else if (kind == 3 && has_pre) load4_##S(t, q, m, s, r == 0, 1, pre);        \
            else if (kind == 3 && r == 0) load4_##S(t, q, m, s, 1, 0, pre);             \
            else if (kind == 3) load4_##S(t, q, m, s, 0, 0, pre);                       \
            else load_##S(t, q, m, s, r == 0, has_pre, pre, kind, table);               \
        }                                                                               \
        if (average) for (int64_t i = 0; i < m; i++) t[i] = t[i] / count;               \
        if (has_post) for (int64_t i = 0; i < m; i++) t[i] = t[i] * post;               \
        int bad;                                                                        \
        int8_t *vb = vals + VOFF(kind, lo);                                             \
        if (res) {                                                                      \
            T *rb = res + lo;                                                           \
            for (int64_t i = 0; i < m; i++) t[i] = t[i] + rb[i];                        \
            bad = kind == 0 ? block_##S(t, NULL, rb, NULL, m, scales + b, vb, 0, qmax, table) \
                : kind == 1 ? block_##S(t, NULL, rb, NULL, m, scales + b, vb, 1, qmax, table) \
                : kind == 3 ? block_##S(t, NULL, rb, NULL, m, scales + b, vb, 3, qmax, table) \
                : block_##S(t, NULL, rb, NULL, m, scales + b, vb, 2, qmax, table);      \
        } else {                                                                        \
            bad = kind == 0 ? block_##S(t, NULL, NULL, NULL, m, scales + b, vb, 0, qmax, table) \
                : kind == 1 ? block_##S(t, NULL, NULL, NULL, m, scales + b, vb, 1, qmax, table) \
                : kind == 3 ? block_##S(t, NULL, NULL, NULL, m, scales + b, vb, 3, qmax, table) \
                : block_##S(t, NULL, NULL, NULL, m, scales + b, vb, 2, qmax, table);    \
        }                                                                               \
        if (bad) { free(t); return b; }                                                 \
    }                                                                                   \
    free(t);                                                                            \
    return nb;                                                                          \
}

DEFINE_KERNELS(float, uint32_t, f32, 0x7f800000u)
DEFINE_KERNELS(double, uint64_t, f64, 0x7ff0000000000000ull)
