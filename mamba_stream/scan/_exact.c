/* The exact backend's kernels (scan/_exact.py builds and loads this file).
 *
 * One rule makes every result independent of chunking, batching, threads and instruction set:
 * each output element is computed by the same sequence of IEEE-754 basic operations (+, -, *, /,
 * sqrt, rint, exact scaling by powers of two), in the same order, whatever else is computed
 * beside it. So: no fused multiply-add the source does not write (built with -ffp-contract=off:
 * the compiler never fuses; the exact-2 products' fused multiply-adds are written out, one IEEE
 * fusedMultiplyAdd each), no reassociation (no -ffast-math), every reduction sequential in a
 * fixed order, and the transcendental functions
 * written here from basic operations in double precision instead of taken from libm or a vector
 * library. Vectorization only ever runs independent elements side by side.
 *
 * The torch twins in scan/_exact.py perform the same operations in the same order and give the
 * same bits; tests/scan/test_exact.py holds the two equal with torch.equal.
 *
 * Every kernel exists for float (suffix _f32) and double (_f64): `T` below.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__)
/* vectors passed between static functions of this file only: no ABI is crossed */
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

typedef int64_t i64;

/* --- transcendentals in double, from basic operations ------------------------------------ */

static const double INV_LN2 = 1.44269504088896338700;
static const double LN2_HI = 6.93147180369123816490e-01; /* k * LN2_HI is exact for |k| < 2^20 */
static const double LN2_LO = 1.90821492927058770002e-10;
static const double SQRT_HALF = 0.70710678118654752440;
static const double TWO_OVER_PI = 6.36619772367581382433e-01;
static const double PIO2_1 = 1.57079632673412561417e+00;  /* fdlibm's three-part pi/2 */
static const double PIO2_2 = 6.07710050650619224932e-11;
static const double PIO2_3 = 2.02226624879595063154e-21;

static const double ROUNDER = 6755399441055744.0; /* 1.5 * 2^52: v + ROUNDER rounds v to an integer */

static inline double bits_to_double(uint64_t b) {
    double d;
    memcpy(&d, &b, 8);
    return d;
}

static inline uint64_t double_to_bits(double d) {
    uint64_t b;
    memcpy(&b, &d, 8);
    return b;
}

/* Horner's rule, p = c[0], then p = p x + c[i] for i = 1 .. n - 1: a multiply then an add, in order
 * (a term written "- c" is "+ (-c)", the same operation). Coefficients from the highest power down:
 * the Taylor series of exp (1/14! .. 1), of expm1 / x (1/18! .. 1), of atanh(s) / s in z = s^2 (1/23 ..
 * 1), of sin r / r (-1/19! .. 1) and of (1 - cos r) / r^2 (1/18! .. 1/2), in z = r^2. */
static const double EXP_POLY[] = {
    1.0 / 87178291200.0, 1.0 / 6227020800.0, 1.0 / 479001600.0, 1.0 / 39916800.0, 1.0 / 3628800.0,
    1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0,
    0.5, 1.0, 1.0};
static const double EXPM1_POLY[] = {
    1.0 / 6402373705728000.0, 1.0 / 355687428096000.0, 1.0 / 20922789888000.0,
    1.0 / 1307674368000.0, 1.0 / 87178291200.0, 1.0 / 6227020800.0, 1.0 / 479001600.0,
    1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0,
    1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0};
static const double LOG_POLY[] = {
    1.0 / 23.0, 1.0 / 21.0, 1.0 / 19.0, 1.0 / 17.0, 1.0 / 15.0, 1.0 / 13.0, 1.0 / 11.0, 1.0 / 9.0,
    1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0};
static const double SIN_POLY[] = {
    -1.0 / 121645100408832000.0, 1.0 / 355687428096000.0, -1.0 / 1307674368000.0,
    1.0 / 6227020800.0, -1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0, -1.0 / 6.0,
    1.0};
static const double COS_POLY[] = {
    1.0 / 6402373705728000.0, -1.0 / 20922789888000.0, 1.0 / 87178291200.0, -1.0 / 479001600.0,
    1.0 / 3628800.0, -1.0 / 40320.0, 1.0 / 720.0, -1.0 / 24.0, 0.5};

static inline double horner(const double *c, int n, double x) {
    double p = c[0];
    for (int i = 1; i < n; i++) p = p * x + c[i];
    return p;
}
#define HORNER(c, x) horner(c, (int)(sizeof c / sizeof c[0]), x)

/* e^x: k = rint(x / ln 2), r = x - k ln 2, a degree-14 Taylor polynomial, times 2^k. Below -708
 * the result is 0 (flushing what would be subnormal), above 709 it is +inf; NaN stays NaN.
 * Branch-free, so that loops over it vectorize (each lane the same operations). */
static inline double xexp(double x) {
    double xc = x > 709.0 ? 709.0 : x;
    xc = xc < -708.0 ? -708.0 : xc;
    double t = xc * INV_LN2 + ROUNDER; /* the integer nearest x / ln 2 (ties to even), in the low bits */
    double k = t - ROUNDER;
    double r = (xc - k * LN2_HI) - k * LN2_LO;
    double p = HORNER(EXP_POLY, r);
    double scale = bits_to_double((double_to_bits(t) + 1023) << 52); /* 2^k */
    double out = p * scale;
    out = x > 709.0 ? INFINITY : out;
    out = x < -708.0 ? 0.0 : out;
    return out;
}

/* e^x - 1, accurate near 0: a series for |x| < 1/2, e^x - 1 elsewhere. */
static inline double xexpm1(double x) {
    int small = x > -0.5 && x < 0.5;
    double xs = small ? x : 0.0;
    double p = HORNER(EXPM1_POLY, xs);
    return small ? x * p : xexp(x) - 1.0;
}

/* log(u) for u >= 1 (finite): u = m 2^e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s). */
static inline double xlog_ge1(double u) {
    uint64_t bits = double_to_bits(u);
    /* the biased exponent as a double by its bits (2^52 + e, less 2^52: exact), not by a conversion
     * from a 64-bit integer, which AVX2 has no vector instruction for: the loops over softplus
     * vectorize (1.5 ms of a 130M Mamba-1 decode step was its scalar loop). k is the same
     * integer either way. */
    double eb = bits_to_double(0x4330000000000000ULL | ((bits >> 52) & 0x7ff)) - 4503599627370496.0;
    double m = bits_to_double((bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL);
    int big = m > 2.0 * SQRT_HALF;
    m = big ? m * 0.5 : m;
    double k = (eb - 1023.0) + (big ? 1.0 : 0.0);
    double f = m - 1.0;
    double s = f / (2.0 + f);
    double z = s * s;
    double p = HORNER(LOG_POLY, z);
    return k * LN2_HI + (k * LN2_LO + 2.0 * s * p);
}

/* log(1 + y) for y > 0 (Goldberg: log(u) * y / (u - 1) with u = 1 + y rounded). */
static inline double xlog1p_pos(double y) {
    double u = 1.0 + y;
    int one = u == 1.0;
    double us = one ? 2.0 : u;
    double v = xlog_ge1(us) * (y / (us - 1.0));
    return one ? y : v;
}

static inline double xsilu(double x) { return x / (1.0 + xexp(-x)); }
static inline double xsigmoid(double x) { return 1.0 / (1.0 + xexp(-x)); }

static inline double xsoftplus(double x) {
    double xs = x > 20.0 ? 0.0 : x;
    double v = xlog1p_pos(xexp(xs));
    return x > 20.0 ? x : v;
}

static inline double xtanh(double x) {
    double a = x < 0.0 ? -x : x;
    int big = a > 20.0;
    double e = xexpm1(2.0 * (big ? 0.0 : a));
    double t = big ? 1.0 : e / (e + 2.0);
    return x < 0.0 ? -t : t;
}

/* 1/sqrt(v) for v > 0: a bit-level first guess, then five Newton steps y = y (1.5 - (v/2 y) y).
 * (libm's and torch's square roots are not all correctly rounded alike; this is the same anywhere.) */
static inline double xrsqrt(double v) {
    double y = bits_to_double(0x5FE6EB50C7B537A9ULL - (double_to_bits(v) >> 1));
    double h = 0.5 * v;
    y = y * (1.5 - (h * y) * y);
    y = y * (1.5 - (h * y) * y);
    y = y * (1.5 - (h * y) * y);
    y = y * (1.5 - (h * y) * y);
    y = y * (1.5 - (h * y) * y);
    return y;
}

/* sin and cos: n = rint(x 2/pi), r = x - n pi/2 in three parts, Taylor polynomials on
 * |r| <= pi/4, the quadrant n mod 4. */
static inline void xsincos(double x, double *sn, double *cs) {
    double t = x * TWO_OVER_PI + ROUNDER;
    double n = t - ROUNDER;
    double r = ((x - n * PIO2_1) - n * PIO2_2) - n * PIO2_3;
    double z = r * r;
    double ps = HORNER(SIN_POLY, z);
    double s = r * ps;
    double pc = HORNER(COS_POLY, z);
    double c = 1.0 - z * pc;
    uint64_t q = double_to_bits(t) & 3; /* n mod 4 */
    *sn = q == 0 ? s : q == 1 ? c : q == 2 ? -s : -c;
    *cs = q == 0 ? c : q == 1 ? -s : q == 2 ? -c : s;
}

static inline double xsin(double x) {
    double s, c;
    xsincos(x, &s, &c);
    return s;
}

static inline double xcos(double x) {
    double s, c;
    xsincos(x, &s, &c);
    return c;
}

/* out[i] = f(x[i]) for one of the functions above, computed in double, rounded to T. */
#define UNARY_LOOP(T, SUF, NAME)                                                                    \
    static void u_##NAME##SUF(const T *restrict x, T *restrict out, i64 n) {                        \
        for (i64 i = 0; i < n; i++) out[i] = (T)x##NAME((double)x[i]);                              \
    }

/* --- kernels, for T = float and T = double ------------------------------------------------ */

/* Register tiles of the products, by the vector registers of the machine built for (16 lanes of
 * float are 1 AVX-512, 2 AVX or 4 SSE registers; of double, twice that). Speed only: every tile
 * computes each output in the same order. TILE_Q: room for the widest of the tiles. */
#if defined(__AVX512F__)
#define VBYTES 64
#define TILE_M_f32 4
#define TILE_N_f32 4
#define TILE_N1_f32 8 /* decode: 8 weight rows in flight read 15-25% faster than 16 (Zen 4, 2 threads) */
#define TILE_M_f64 2
#define TILE_N_f64 4
#define TILE_N1_f64 8
#elif defined(__AVX__)
#define VBYTES 32
#define TILE_M_f32 2
#define TILE_N_f32 3
#define TILE_N1_f32 6
#define TILE_M_f64 1
#define TILE_N_f64 3
#define TILE_N1_f64 3
#else
#define VBYTES 16
#define TILE_M_f32 1
#define TILE_N_f32 3
#define TILE_N1_f32 3
#define TILE_M_f64 1
#define TILE_N_f64 1
#define TILE_N1_f64 1
#endif
#define TILE_Q_f32 (TILE_N1_f32 > TILE_N_f32 ? TILE_N1_f32 : TILE_N_f32)
#define TILE_Q_f64 (TILE_N1_f64 > TILE_N_f64 ? TILE_N1_f64 : TILE_N_f64)
/* the exact-2 products' tiles (AR _fma): their own, since a fused step frees a register and an
 * issue slot a multiply-add */
#define TILE_M_fma_f32 TILE_M_f32
#define TILE_N_fma_f32 TILE_N_f32
#define TILE_N1_fma_f32 TILE_N1_f32
#define TILE_Q_fma_f32 (TILE_N1_fma_f32 > TILE_N_fma_f32 ? TILE_N1_fma_f32 : TILE_N_fma_f32)
/* A value loaded once into a register, for the tile's products to use from there: left alone,
 * GCC folds each use into its multiply as a memory operand, so a 4 x 4 tile loads its operands 32
 * times a step instead of 8 and the loads, not the arithmetic, set the pace (float32 prefill
 * products 55-63 -> 84-101 GFLOP/s on 2 Zen 4 threads, the two builds interleaved; decode and
 * bfloat16 weights unchanged). An empty asm: no instruction, no change to any value. */
#if defined(__AVX512F__)
#define IN_REGISTER(v) __asm__("" : "+v"(v))
#else
#define IN_REGISTER(v) __asm__("" : "+x"(v))
#endif
/* weights fetched ahead go to every cache level (prefetcht0): the non-temporal hint
 * (prefetchnta) read weights from memory at a third of the rate on Sapphire Rapids (bfloat16 rows
 * 2.6 against 8.3 G weights/s, q8 5.8 against 12.5, one thread) */
#define PREFETCH_LOCALITY 3
/* outputs per cache block: their weight rows stay in L2 while every row of x passes */
#define BLOCK_N 96

/* --- the products ------------------------------------------------------------------------- */

/* Weights are read in the format they are stored in (float32 or float64 as the computation,
 * bfloat16, float16) and widened to T as they are loaded: widening is exact, so a product over
 * stored bfloat16 weights gives the bits of the same product over their float32 copies. */
typedef uint16_t bf16_t;
typedef uint16_t f16_t;

static inline float bf16_to_float(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* IEEE half to float by integer operations (exact; no subnormal is ever an operand, so a
 * flush-to-zero mode cannot change it): normal values rebias the exponent, subnormal ones are
 * m 2^-24, infinities and NaNs keep their payload. */
static inline float f16_to_float(f16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    uint32_t bits = e == 0x1f ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    f = e == 0 ? (float)m * 0x1p-24f : f;
    uint32_t out;
    memcpy(&out, &f, 4);
    out |= sign;
    memcpy(&f, &out, 4);
    return f;
}

/* The lanes of one native vector added by the tree (j, j + W/2), then (j, j + W/4), ... (0, 1):
 * lanes_generic_* as a loop over the lanes; lanes_native_f32 the same additions on float vectors
 * of AVX or AVX-512, halves added by whole vectors (the scalar loop cost a 4 x 4 tile of
 * 768-long dots about a third of its time). */
#define DEFINE_LANES(T, SUF)                                                                        \
    static inline __attribute__((always_inline)) T lanes_generic##SUF(                              \
        T __attribute__((vector_size(VBYTES))) v) {                                                 \
        enum { W = VBYTES / sizeof(T) };                                                            \
        T s[W];                                                                                     \
        memcpy(s, &v, sizeof s);                                                                    \
        for (int span = W / 2; span >= 1; span /= 2)                                                \
            for (int j = 0; j < span; j++) s[j] = s[j] + s[j + span];                               \
        return s[0];                                                                                \
    }
DEFINE_LANES(float, _f32)
DEFINE_LANES(double, _f64)
#define LANES_f64 lanes_generic_f64
#if VBYTES == 64 || VBYTES == 32
#include <immintrin.h>
static inline __attribute__((always_inline)) float lanes_native_f32(float __attribute__((vector_size(VBYTES))) v) {
#if VBYTES == 64
    __m512 z;
    memcpy(&z, &v, 64);
    __m256 y = _mm256_add_ps(_mm512_castps512_ps256(z),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(z), 1))); /* (j, j + 8) */
#else
    __m256 y;
    memcpy(&y, &v, 32);
#endif
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1)); /* (j, j + 4) */
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));                                           /* (j, j + 2) */
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));                                       /* (0, 1) */
    return _mm_cvtss_f32(x);
}
#define LANES_f32 lanes_native_f32
#else
#define LANES_f32 lanes_generic_f32
#endif

#define DEFINE_VECTORS(T, SUF)                                                                      \
    typedef T L##SUF __attribute__((vector_size(16 * sizeof(T))));                                 \
    typedef T V##SUF __attribute__((vector_size(VBYTES)));                                          \
    enum { NV##SUF = 16 * sizeof(T) / VBYTES, W##SUF = VBYTES / sizeof(T) };                       \
    /* the lane tree on NV native vectors: whole vectors while the span is a multiple of W, then   \
     * lanes; the same additions as on 16 lanes at once */                                          \
    static inline __attribute__((always_inline)) T ltree##SUF(const V##SUF *c) {                    \
        V##SUF v[NV##SUF];                                                                          \
        int nv = NV##SUF;                                                                           \
        for (int i = 0; i < nv; i++) v[i] = c[i];                                                   \
        while (nv > 1) {                                                                            \
            nv /= 2;                                                                                \
            for (int i = 0; i < nv; i++) v[i] = v[i] + v[i + nv];                                   \
        }                                                                                           \
        return LANES##SUF(v[0]);                                                                    \
    }                                                                                               \
    /* W lanes of weights, widened to T */                                                          \
    static inline __attribute__((always_inline)) V##SUF wv_same##SUF(const T *p) {                  \
        V##SUF b;                                                                                   \
        memcpy(&b, p, VBYTES);                                                                      \
        return b;                                                                                   \
    }                                                                                               \
    static inline __attribute__((always_inline)) V##SUF wv_bf16_generic##SUF(const bf16_t *p) {    \
        typedef uint16_t H __attribute__((vector_size(W##SUF * 2)));                                \
        typedef uint32_t U __attribute__((vector_size(W##SUF * 4)));                                \
        typedef float F __attribute__((vector_size(W##SUF * 4)));                                   \
        H h;                                                                                        \
        memcpy(&h, p, sizeof h);                                                                    \
        U u = __builtin_convertvector(h, U) << 16;                                                  \
        F f;                                                                                        \
        memcpy(&f, &u, sizeof f);                                                                   \
        return __builtin_convertvector(f, V##SUF);                                                  \
    }                                                                                               \
    static inline __attribute__((always_inline)) V##SUF wv_f16##SUF(const f16_t *p) {              \
        typedef float F __attribute__((vector_size(W##SUF * 4)));                                   \
        F f = F16W##SUF(p);                                                                         \
        return __builtin_convertvector(f, V##SUF);                                                  \
    }                                                                                               \
    static inline T w1_same##SUF(const T *p) { return *p; }                                         \
    static inline T w1_bf16##SUF(const bf16_t *p) { return (T)bf16_to_float(*p); }                  \
    static inline T w1_f16##SUF(const f16_t *p) { return (T)f16_to_float(*p); }

/* n float16 values to n floats (the lanes of one vector of T): F16C's conversion where the
 * machine has it (exact, like the integer one), else lane by lane. */
typedef float f16x_v2 __attribute__((vector_size(8)));
typedef float f16x_v4 __attribute__((vector_size(16)));
typedef float f16x_v8 __attribute__((vector_size(32)));
typedef float f16x_v16 __attribute__((vector_size(64)));
#define F16_LANES(n)                                                                                \
    static inline f16x_v##n f16x##n##_scalar(const f16_t *p) {                                      \
        f16x_v##n out;                                                                              \
        for (int j = 0; j < n; j++) out[j] = f16_to_float(p[j]);                                    \
        return out;                                                                                 \
    }
F16_LANES(2)
F16_LANES(4)
F16_LANES(8)
F16_LANES(16)
#if defined(__F16C__)
#include <immintrin.h>
static inline f16x_v8 f16x8(const f16_t *p) {
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    f16x_v8 out;
    memcpy(&out, &f, 32);
    return out;
}
static inline f16x_v16 f16x16(const f16_t *p) {
    f16x_v8 a = f16x8(p), b = f16x8(p + 8);
    f16x_v16 out;
    memcpy(&out, &a, 32);
    memcpy((char *)&out + 32, &b, 32);
    return out;
}
static inline f16x_v4 f16x4(const f16_t *p) {
    long long raw;
    memcpy(&raw, p, 8);
    __m128 f = _mm_cvtph_ps(_mm_cvtsi64_si128(raw));
    f16x_v4 out;
    memcpy(&out, &f, 16);
    return out;
}
#else
#define f16x16 f16x16_scalar
#define f16x8 f16x8_scalar
#define f16x4 f16x4_scalar
#endif
#define f16x2 f16x2_scalar
/* the widening for one vector of float (_f32) or of double (_f64) */
#if VBYTES == 64
#define F16W_f32 f16x16
#define F16W_f64 f16x8
#elif VBYTES == 32
#define F16W_f32 f16x8
#define F16W_f64 f16x4
#else
#define F16W_f32 f16x4
#define F16W_f64 f16x2
#endif

/* out[m, n] = dot(x[m, :], w[n, :]) [+ bias[n]] in one fixed order: k is split into 16 lanes
 * (lane j takes k = j, j + 16, ...; x and w read as zero past K), each lane summed in order
 * from 0, one MADD a step (exact-1: a multiply then an add; exact-2, AR _fma: one fused
 * multiply-add), and the lanes added by a fixed tree: (j, j + 8), then (j, j + 4), (j, j + 2),
 * (0, 1). x (M, K), w (N, K): the weight as it is stored, of type WT (`WN` names it in the
 * kernel's name), widened to T as it is read. Every output takes this
 * order whatever M, the tile it falls in or the thread that computes it; the tiles (TILE_M rows
 * x TILE_N outputs, 1 row x TILE_N1 outputs for decode, in blocks of BLOCK_N outputs that stay
 * in cache) and the vectors that hold the 16 lanes (NV native vectors of W lanes) only choose
 * what is loaded together, for the registers this machine has. */
#define DEFINE_LINEAR(T, SUF, WT, WN, AR, MADD)                                                     \
    static inline L##SUF lload##AR##WN##SUF(const WT *p, i64 k, i64 K) {                            \
        L##SUF v;                                                                                   \
        for (int j = 0; j < 16; j++) v[j] = k + j < K ? w1##WN##SUF(p + k + j) : (T)0;              \
        return v;                                                                                   \
    }                                                                                               \
    static inline L##SUF xload##AR##WN##SUF(const T *p, i64 k, i64 K) {                             \
        L##SUF v;                                                                                   \
        for (int j = 0; j < 16; j++) v[j] = k + j < K ? p[k + j] : (T)0;                            \
        return v;                                                                                   \
    }                                                                                               \
    /* outputs [m, m + R) x [n, n + Q) */                                                           \
    static inline __attribute__((always_inline)) void tile##AR##WN##SUF(                            \
        const T *x, i64 K, const WT *w, T *out, i64 N, i64 m, i64 n, const int R, const int Q) {    \
        V##SUF c[TILE_M##AR##SUF][TILE_Q##AR##SUF][NV##SUF];                                                \
        for (int r = 0; r < R; r++)                                                                 \
            for (int q = 0; q < Q; q++)                                                             \
                for (int v = 0; v < NV##SUF; v++) c[r][q][v] = (V##SUF){0};                         \
        i64 kf = K / 16 * 16;                                                                       \
        /* the next outputs' weight rows, fetched while these are computed: a narrow row is a     \
         * short stream (2-4 KB) that the hardware prefetcher would find only half-way through    \
         * (measured: bfloat16 rows 3.6 -> 4.8 G weights/s on one thread, Zen 4; float32 rows     \
         * slower). Into every cache level (PREFETCH_LOCALITY): a non-temporal prefetch cost a    \
         * Sapphire Rapids core two thirds of its bfloat16 rate (2.6 against 8.3 G weights/s). */ \
        const WT *next = w + (n + Q < N ? n + Q : n) * K;                                           \
        int more = sizeof(WT) < sizeof(float) && n + 2 * Q <= N; /* float rows are long enough */   \
        for (i64 k = 0; k < kf; k += 16) {                                                          \
            if (more)                                                                               \
                for (int q = 0; q < Q; q++) __builtin_prefetch(next + q * K + k, 0, PREFETCH_LOCALITY); \
            for (int v = 0; v < NV##SUF; v++) {                                                     \
                V##SUF a[TILE_M##AR##SUF];                                                              \
                for (int r = 0; r < R; r++) {                                                       \
                    V##SUF t;                                                                       \
                    memcpy(&t, x + (m + r) * K + k + v * W##SUF, VBYTES);                           \
                    IN_REGISTER(t);                                                                 \
                    a[r] = t;                                                                       \
                }                                                                                   \
                for (int q = 0; q < Q; q++) {                                                       \
                    V##SUF b = wv##WN##SUF(w + (n + q) * K + k + v * W##SUF);                       \
                    IN_REGISTER(b);                                                                 \
                    for (int r = 0; r < R; r++) c[r][q][v] = MADD##SUF(a[r], b, c[r][q][v]);       \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < R; r++)                                                                 \
            for (int q = 0; q < Q; q++) {                                                           \
                if (kf < K) {                                                                       \
                    L##SUF xl = xload##AR##WN##SUF(x + (m + r) * K, kf, K);                         \
                    L##SUF wl = lload##AR##WN##SUF(w + (n + q) * K, kf, K);                         \
                    V##SUF xv[NV##SUF], wv[NV##SUF];                                                \
                    memcpy(xv, &xl, sizeof xl);                                                     \
                    memcpy(wv, &wl, sizeof wl);                                                     \
                    for (int v = 0; v < NV##SUF; v++) c[r][q][v] = MADD##SUF(xv[v], wv[v], c[r][q][v]); \
                }                                                                                   \
                out[(m + r) * N + n + q] = ltree##SUF(c[r][q]);                                     \
            }                                                                                       \
    }                                                                                               \
    static void tile_mn##AR##WN##SUF(const T *x, i64 K, const WT *w, T *out, i64 N, i64 m, i64 n) { \
        tile##AR##WN##SUF(x, K, w, out, N, m, n, TILE_M##AR##SUF, TILE_N##AR##SUF);                         \
    }                                                                                               \
    static void tile_1n##AR##WN##SUF(const T *x, i64 K, const WT *w, T *out, i64 N, i64 m, i64 n) { \
        tile##AR##WN##SUF(x, K, w, out, N, m, n, 1, TILE_N1##AR##SUF);                                  \
    }                                                                                               \
    static void tile_11##AR##WN##SUF(const T *x, i64 K, const WT *w, T *out, i64 N, i64 m, i64 n) { \
        tile##AR##WN##SUF(x, K, w, out, N, m, n, 1, 1);                                             \
    }                                                                                               \
    void linear##AR##WN##SUF(const T *x, i64 M, i64 K, const WT *w, i64 N, const T *bias, T *out,  \
                             i64 n0, i64 n1) {                                                      \
        for (i64 b0 = n0; b0 < n1; b0 += BLOCK_N) {                                                 \
            i64 b1 = b0 + BLOCK_N < n1 ? b0 + BLOCK_N : n1;                                         \
            i64 m = 0;                                                                              \
            for (; m + TILE_M##AR##SUF <= M; m += TILE_M##AR##SUF) {                                        \
                i64 n = b0;                                                                         \
                for (; n + TILE_N##AR##SUF <= b1; n += TILE_N##AR##SUF) tile_mn##AR##WN##SUF(x, K, w, out, N, m, n); \
                for (; n < b1; n++)                                                                 \
                    for (int r = 0; r < TILE_M##AR##SUF; r++) tile_11##AR##WN##SUF(x, K, w, out, N, m + r, n); \
            }                                                                                       \
            for (; m < M; m++) {                                                                    \
                i64 n = b0;                                                                         \
                for (; n + TILE_N1##AR##SUF <= b1; n += TILE_N1##AR##SUF) tile_1n##AR##WN##SUF(x, K, w, out, N, m, n); \
                for (; n < b1; n++) tile_11##AR##WN##SUF(x, K, w, out, N, m, n);                    \
            }                                                                                       \
        }                                                                                           \
        if (bias)                                                                                   \
            for (i64 r = 0; r < M; r++)                                                             \
                for (i64 n = n0; n < n1; n++) out[r * N + n] = out[r * N + n] + bias[n];            \
    }

DEFINE_VECTORS(float, _f32)
DEFINE_VECTORS(double, _f64)

/* bfloat16 to float, a vector at a time: zero-extend each 16-bit value in place (lane order kept),
 * shift it to the top half. GCC splits the generic conversion into five instructions on AVX2. */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline __attribute__((always_inline)) V_f32 wv_bf16_f32(const bf16_t *p) {
    __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    V_f32 v;
    memcpy(&v, &f, sizeof v);
    return v;
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline __attribute__((always_inline)) V_f32 wv_bf16_f32(const bf16_t *p) {
    __m256 f = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    V_f32 v;
    memcpy(&v, &f, sizeof v);
    return v;
}
#else
#define wv_bf16_f32 wv_bf16_generic_f32
#endif
#define wv_bf16_f64 wv_bf16_generic_f64
/* One step of a lane's sum, c + a * b. exact-1 rounds the product, then the sum; exact-2 rounds
 * once: IEEE-754's fusedMultiplyAdd, which an FMA instruction and C's fmaf compute alike (fmaf
 * in software where the machine has no FMA: slower, the same bits). */
static inline __attribute__((always_inline)) V_f32 madd_split_f32(V_f32 a, V_f32 b, V_f32 c) { return c + a * b; }
static inline __attribute__((always_inline)) V_f64 madd_split_f64(V_f64 a, V_f64 b, V_f64 c) { return c + a * b; }
static inline __attribute__((always_inline)) V_f32 madd_fused_f32(V_f32 a, V_f32 b, V_f32 c) {
#if VBYTES == 64
    __m512 x, y, z;
    memcpy(&x, &a, 64);
    memcpy(&y, &b, 64);
    memcpy(&z, &c, 64);
    z = _mm512_fmadd_ps(x, y, z);
    memcpy(&c, &z, 64);
#elif VBYTES == 32 && defined(__FMA__)
    __m256 x, y, z;
    memcpy(&x, &a, 32);
    memcpy(&y, &b, 32);
    memcpy(&z, &c, 32);
    z = _mm256_fmadd_ps(x, y, z);
    memcpy(&c, &z, 32);
#else
    for (int j = 0; j < W_f32; j++) c[j] = fmaf(a[j], b[j], c[j]);
#endif
    return c;
}

/* linear_same_f32 / linear_same_f64: weights of the computation's type; linear_bf16_f32,
 * linear_f16_f32, ...: weights stored in bfloat16 or float16. linear_fma_*_f32: the same with
 * fused multiply-adds (the exact-2 arithmetic; float32 computations only). */
DEFINE_LINEAR(float, _f32, float, _same, , madd_split)
DEFINE_LINEAR(float, _f32, bf16_t, _bf16, , madd_split)
DEFINE_LINEAR(float, _f32, f16_t, _f16, , madd_split)
DEFINE_LINEAR(double, _f64, double, _same, , madd_split)
DEFINE_LINEAR(double, _f64, bf16_t, _bf16, , madd_split)
DEFINE_LINEAR(double, _f64, f16_t, _f16, , madd_split)
DEFINE_LINEAR(float, _f32, float, _same, _fma, madd_fused)
DEFINE_LINEAR(float, _f32, bf16_t, _bf16, _fma, madd_fused)
DEFINE_LINEAR(float, _f32, f16_t, _f16, _fma, madd_fused)

#define DEFINE_KERNELS(T, SUF)                                                                      \
                                                                                                    \
    /* Elementwise: op 0 exp, 1 silu, 2 sigmoid, 3 softplus, 4 tanh, 5 sin, 6 cos, 7 rsqrt (a loop  \
     * each, so that each vectorizes). */                                                           \
    UNARY_LOOP(T, SUF, exp)                                                                         \
    UNARY_LOOP(T, SUF, silu)                                                                        \
    UNARY_LOOP(T, SUF, sigmoid)                                                                     \
    UNARY_LOOP(T, SUF, softplus)                                                                    \
    UNARY_LOOP(T, SUF, tanh)                                                                        \
    UNARY_LOOP(T, SUF, sin)                                                                         \
    UNARY_LOOP(T, SUF, cos)                                                                         \
    UNARY_LOOP(T, SUF, rsqrt)                                                                       \
    void unary##SUF(const T *x, T *out, i64 n, int op) {                                            \
        switch (op) {                                                                               \
            case 0: u_exp##SUF(x, out, n); break;                                                   \
            case 1: u_silu##SUF(x, out, n); break;                                                  \
            case 2: u_sigmoid##SUF(x, out, n); break;                                               \
            case 3: u_softplus##SUF(x, out, n); break;                                              \
            case 4: u_tanh##SUF(x, out, n); break;                                                  \
            case 5: u_sin##SUF(x, out, n); break;                                                   \
            case 6: u_cos##SUF(x, out, n); break;                                                   \
            default: u_rsqrt##SUF(x, out, n); break;                                                \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* y = (x * rsqrt(mean(x * x) + e)) * w over n values, the mean summed in order (y may be x). */\
    static inline void rms_group##SUF(const T *x, const T *w, T *y, i64 n, T e) {                   \
        T s = (T)0;                                                                                 \
        for (i64 j = 0; j < n; j++) s = s + x[j] * x[j];                                            \
        T inv = (T)xrsqrt((double)(s / (T)n + e));                                                  \
        for (i64 j = 0; j < n; j++) y[j] = (x[j] * inv) * w[j];                                     \
    }                                                                                               \
                                                                                                    \
    /* RMSNorm of rows, then the weight. x, y (rows, D); w (D,). */                                 \
    void rms_norm##SUF(const T *x, const T *w, T *y, i64 rows, i64 d, double eps) {                 \
        for (i64 r = 0; r < rows; r++) rms_group##SUF(x + r * d, w, y + r * d, d, (T)eps);          \
    }                                                                                               \
                                                                                                    \
    /* mamba-ssm's RMSNormGated per group of `gs` channels: norm(x silu(z)) w, or (norm(x) w)       \
     * silu(z) when norm_before_gate. x, z, y (rows, D); w (D,). */                                 \
    void gated_norm##SUF(const T *x, const T *z, const T *w, T *y, i64 rows, i64 d, i64 gs,         \
                         double eps, int before) {                                                  \
        for (i64 r = 0; r < rows; r++) {                                                            \
            const T *xr = x + r * d, *zr = z + r * d;                                               \
            T *yr = y + r * d;                                                                      \
            for (i64 j = 0; j < d; j++) yr[j] = before ? xr[j] : xr[j] * (T)xsilu((double)zr[j]);   \
            for (i64 g0 = 0; g0 < d; g0 += gs) rms_group##SUF(yr + g0, w + g0, yr + g0, gs, (T)eps);\
            if (before)                                                                             \
                for (i64 j = 0; j < d; j++) yr[j] = yr[j] * (T)xsilu((double)zr[j]);                \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
                                                                                                    \
    /* The causal depthwise conv over a chunk: out[b,t,c] = ((f[t+1] w[c,0] + f[t+2] w[c,1]) + ...) \
     * + bias[c], f the state's W inputs then the chunk's. state (B, C, W) oldest first; xs, out    \
     * (B, L, C); w (C, W); new_state (B, C, W): the last W inputs. */                              \
    /* the conv's new state: the last W inputs of [state, xs], written in ascending order (so    \
     * new_state may be state: each value read is at or after the one written) */                  \
    static void conv_state##SUF(const T *state, const T *xs, T *new_state, i64 B, i64 L, i64 C,     \
                                i64 W) {                                                            \
        for (i64 b = 0; b < B; b++)                                                                 \
            for (i64 c = 0; c < C; c++)                                                             \
                for (i64 j = 0; j < W; j++) {                                                       \
                    i64 i = L + j; /* the last W positions of [state, xs] */                        \
                    new_state[(b * C + c) * W + j] =                                                \
                        i < W ? state[(b * C + c) * W + i] : xs[(b * L + i - W) * C + c];           \
                }                                                                                   \
    }                                                                                               \
    void conv##SUF(const T *state, const T *xs, const T *w, const T *bias, T *out, T *new_state,    \
                   i64 B, i64 L, i64 C, i64 W) {                                                    \
        for (i64 b = 0; b < B; b++) {                                                               \
            for (i64 t = 0; t < L; t++) {                                                           \
                T *o = out + (b * L + t) * C;                                                       \
                for (i64 c = 0; c < C; c++) {                                                       \
                    T acc = (T)0;                                                                   \
                    for (i64 j = 0; j < W; j++) {                                                   \
                        i64 i = t + 1 + j; /* position in [state, xs] */                            \
                        T f = i < W ? state[(b * C + c) * W + i] : xs[(b * L + i - W) * C + c];     \
                        acc = j == 0 ? f * w[c * W] : acc + f * w[c * W + j];                       \
                    }                                                                               \
                    o[c] = bias ? acc + bias[c] : acc;                                              \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        conv_state##SUF(state, xs, new_state, B, L, C, W);                                          \
    }                                                                                               \
                                                                                                    \
    /* out[r] = (((0 + x[r,0]) + x[r,1]) + ...) / D: the mean of each row, summed in order. */      \
    void mean_rows##SUF(const T *x, T *out, i64 rows, i64 d) {                                      \
        for (i64 r = 0; r < rows; r++) {                                                            \
            const T *p = x + r * d;                                                                 \
            T s = (T)0;                                                                             \
            for (i64 j = 0; j < d; j++) s = s + p[j];                                               \
            out[r] = s / (T)d;                                                                      \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* Mamba-1, streams [b0, b1): per channel c and token t, h = h e^(dt a) + (dt x) b,             \
     * y = (((0 + h_0 cc_0) + h_1 cc_1) + ...). dt, x, y (B, L, C); at (N, C) the transposed A;     \
     * bm, cm (B, L, N); h0 (B, C, N) the state before, h (B, C, N) out: after.                     \
     * Channels run side by side in blocks of 64 (work units u = b * ceil(C / 64) + block, those   \
     * in [u0, u1) here), the state held transposed meanwhile. */                                   \
    void selective_scan##SUF(const T *dt, const T *at, const T *x, const T *bm, const T *cm,        \
                             const T *h0, T *h, T *y, i64 B, i64 L, i64 C, i64 N, i64 u0, i64 u1) { \
        enum { CB = 64 };                                                                           \
        T ht[N][CB], d[CB], dx[CB], acc[CB];                                                        \
        i64 nblk = (C + CB - 1) / CB;                                                               \
        for (i64 u = u0; u < u1; u++) {                                                             \
            i64 b = u / nblk, c0 = (u % nblk) * CB;                                                 \
            {                                                                                       \
                i64 w = C - c0 < CB ? C - c0 : CB;                                                  \
                for (i64 n = 0; n < N; n++)                                                         \
                    for (i64 j = 0; j < w; j++) ht[n][j] = h0[(b * C + c0 + j) * N + n];            \
                for (i64 t = 0; t < L; t++) {                                                       \
                    const T *dtt = dt + (b * L + t) * C + c0, *xt = x + (b * L + t) * C + c0;       \
                    const T *bt = bm + (b * L + t) * N, *ct = cm + (b * L + t) * N;                 \
                    for (i64 j = 0; j < w; j++) {                                                   \
                        d[j] = dtt[j];                                                              \
                        dx[j] = dtt[j] * xt[j];                                                     \
                        acc[j] = (T)0;                                                              \
                    }                                                                               \
                    for (i64 n = 0; n < N; n++) {                                                   \
                        const T *an = at + n * C + c0;                                              \
                        T bn = bt[n];                                                               \
                        for (i64 j = 0; j < w; j++) {                                               \
                            T decay = (T)xexp((double)(d[j] * an[j]));                              \
                            ht[n][j] = ht[n][j] * decay + dx[j] * bn;                               \
                        }                                                                           \
                    }                                                                               \
                    for (i64 n = 0; n < N; n++) {                                                   \
                        T cn = ct[n];                                                               \
                        for (i64 j = 0; j < w; j++) acc[j] = acc[j] + ht[n][j] * cn;                \
                    }                                                                               \
                    T *yt = y + (b * L + t) * C + c0;                                               \
                    for (i64 j = 0; j < w; j++) yt[j] = acc[j];                                     \
                }                                                                                   \
                for (i64 n = 0; n < N; n++)                                                         \
                    for (i64 j = 0; j < w; j++) h[(b * C + c0 + j) * N + n] = ht[n][j];             \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* Mamba-2 (SSD), units u = b * H + h in [u0, u1): per head h and token t, s = s e^(dt a_h) + (dt x) b^T,      \
     * y_p = (((0 + s_p0 c_0) + s_p1 c_1) + ...). x, y (B, L, H, P); dt (B, L, H); a (H,);          \
     * bm, cm (B, L, G, N); s0 (B, H, P, N) the state before, s after. Heads of a group are         \
     * contiguous. The state of a head is held transposed (N, P) meanwhile, so that its P rows run  \
     * side by side. */                                                                            \
    void ssd_scan##SUF(const T *x, const T *dt, const T *a, const T *bm, const T *cm, const T *s0,  \
                       T *s, T *y, i64 B, i64 L, i64 H, i64 P, i64 G, i64 N, i64 u0, i64 u1) {      \
        i64 hg = H / G;                                                                             \
        T st[N][P], dx[P], acc[P];                                                                  \
        for (i64 u = u0; u < u1; u++) {                                                             \
            i64 b = u / H, h = u % H;                                                               \
            {                                                                                       \
                T *sh = s + (b * H + h) * P * N;                                                    \
                const T *si = s0 + (b * H + h) * P * N;                                             \
                i64 g = h / hg;                                                                     \
                if (L <= 2) { /* decode: the state in its own layout, no transposes; rows of 8      \
                               * side by side so that their sums overlap (the same operations) */   \
                    for (i64 t = 0; t < L; t++) {                                                   \
                        const T *src = t ? sh : si;                                                 \
                        T d = dt[(b * L + t) * H + h];                                              \
                        T decay = (T)xexp((double)(d * a[h]));                                      \
                        const T *xt = x + ((b * L + t) * H + h) * P;                                \
                        const T *bt = bm + ((b * L + t) * G + g) * N;                               \
                        const T *ct = cm + ((b * L + t) * G + g) * N;                               \
                        T *yt = y + ((b * L + t) * H + h) * P;                                      \
                        i64 p = 0;                                                                  \
                        for (; p + 8 <= P; p += 8) {                                                \
                            T dxr[8], ac[8];                                                        \
                            for (int j = 0; j < 8; j++) dxr[j] = d * xt[p + j], ac[j] = (T)0;       \
                            for (int j = 0; j < 8; j++)                                             \
                                for (i64 n = 0; n < N; n++)                                         \
                                    sh[(p + j) * N + n] = src[(p + j) * N + n] * decay + dxr[j] * bt[n]; \
                            for (i64 n = 0; n < N; n++)                                             \
                                for (int j = 0; j < 8; j++) ac[j] = ac[j] + sh[(p + j) * N + n] * ct[n]; \
                            for (int j = 0; j < 8; j++) yt[p + j] = ac[j];                          \
                        }                                                                           \
                        for (; p < P; p++) {                                                        \
                            T dxp = d * xt[p], ac = (T)0;                                           \
                            for (i64 n = 0; n < N; n++) sh[p * N + n] = src[p * N + n] * decay + dxp * bt[n]; \
                            for (i64 n = 0; n < N; n++) ac = ac + sh[p * N + n] * ct[n];            \
                            yt[p] = ac;                                                             \
                        }                                                                           \
                    }                                                                               \
                    continue;                                                                       \
                }                                                                                   \
                for (i64 p = 0; p < P; p++) /* the state's own order: read it in sequence */        \
                    for (i64 n = 0; n < N; n++) st[n][p] = si[p * N + n];                           \
                for (i64 t = 0; t < L; t++) {                                                       \
                    T d = dt[(b * L + t) * H + h];                                                  \
                    T decay = (T)xexp((double)(d * a[h]));                                          \
                    const T *xt = x + ((b * L + t) * H + h) * P;                                    \
                    const T *bt = bm + ((b * L + t) * G + g) * N;                                   \
                    const T *ct = cm + ((b * L + t) * G + g) * N;                                   \
                    for (i64 p = 0; p < P; p++) {                                                   \
                        dx[p] = d * xt[p];                                                          \
                        acc[p] = (T)0;                                                              \
                    }                                                                               \
                    for (i64 n = 0; n < N; n++) {                                                   \
                        T bn = bt[n];                                                               \
                        for (i64 p = 0; p < P; p++) st[n][p] = st[n][p] * decay + dx[p] * bn;       \
                    }                                                                               \
                    for (i64 n = 0; n < N; n++) {                                                   \
                        T cn = ct[n];                                                               \
                        for (i64 p = 0; p < P; p++) acc[p] = acc[p] + st[n][p] * cn;                \
                    }                                                                               \
                    T *yt = y + ((b * L + t) * H + h) * P;                                          \
                    for (i64 p = 0; p < P; p++) yt[p] = acc[p];                                     \
                }                                                                                   \
                for (i64 p = 0; p < P; p++)                                                         \
                    for (i64 n = 0; n < N; n++) sh[p * N + n] = st[n][p];                           \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
                                                                                                    \
    /* Mamba-3 angles, streams [b0, b1): theta_t = wrap(theta_{t-1} + inc_t), wrap(v) =             \
     * v - 2 pi floor(v / 2 pi). inc, theta (B, L, H, S); angle (B, H, S) in: before, out: after. */\
    void angle_scan##SUF(const T *inc, T *angle, T *theta, i64 B, i64 L, i64 HS, i64 b0, i64 b1) {  \
        const T two_pi = (T)6.283185307179586;                                                      \
        for (i64 b = b0; b < b1; b++)                                                               \
            for (i64 t = 0; t < L; t++)                                                             \
                for (i64 i = 0; i < HS; i++) {                                                      \
                    T v = angle[b * HS + i] + inc[(b * L + t) * HS + i];                            \
                    v = v - two_pi * (T)floor((double)(v / two_pi));                                \
                    angle[b * HS + i] = v;                                                          \
                    theta[(b * L + t) * HS + i] = v;                                                \
                }                                                                                   \
    }                                                                                               \
                                                                                                    \
    /* Mamba-3 trapezoid, units u = b * H + h in [u0, u1): per head h and token t, over the ranks in order        \
     * upd = sum (beta xr'_r) k'_r^T + (gamma xr_r) k_r^T, s = s alpha + upd, and                    \
     * y_r,p = (((0 + s_p0 q_r0) + s_p1 q_r1) + ...) + D_h xr_r,p; primes are the previous token's.  \
     * q, k (B, L, R, H, N); xr (B, L, R, H, P); alpha, beta, gamma (B, L, H); s0 (B, H, P, N) the  \
     * state before, s after; kp (B, R, H, N), xp (B, R, H, P) in place; y (B, L, R, H, P). */     \
    void trapezoid_scan##SUF(const T *q, const T *k, const T *xr, const T *alpha, const T *beta,    \
                             const T *gamma, const T *D, const T *s0, T *s, T *kp, T *xp, T *y,     \
                             i64 B, i64 L,                                                          \
                             i64 R, i64 H, i64 P, i64 N, i64 u0, i64 u1) {                          \
        T st[N][P], bx[R][P], gx[R][P], acc[P];                                                     \
        for (i64 u = u0; u < u1; u++) {                                                             \
            i64 b = u / H, h = u % H;                                                               \
            {                                                                                       \
                T *sh = s + (b * H + h) * P * N;                                                    \
                const T *si = s0 + (b * H + h) * P * N;                                             \
                for (i64 p = 0; p < P; p++) /* the state's own order: read it in sequence */        \
                    for (i64 n = 0; n < N; n++) st[n][p] = si[p * N + n];                           \
                for (i64 t = 0; t < L; t++) {                                                       \
                    i64 bt = (b * L + t) * H + h;                                                   \
                    T al = alpha[bt], be = beta[bt], ga = gamma[bt];                                \
                    for (i64 r = 0; r < R; r++) {                                                   \
                        const T *xpr = xp + ((b * R + r) * H + h) * P;                              \
                        const T *xrr = xr + (((b * L + t) * R + r) * H + h) * P;                    \
                        for (i64 p = 0; p < P; p++) {                                               \
                            bx[r][p] = be * xpr[p];                                                 \
                            gx[r][p] = ga * xrr[p];                                                 \
                        }                                                                           \
                    }                                                                               \
                    for (i64 n = 0; n < N; n++) {                                                   \
                        for (i64 r = 0; r < R; r++) {                                               \
                            T kpn = kp[((b * R + r) * H + h) * N + n];                              \
                            T kn = k[(((b * L + t) * R + r) * H + h) * N + n];                      \
                            if (r == 0) {                                                           \
                                for (i64 p = 0; p < P; p++) acc[p] = bx[0][p] * kpn + gx[0][p] * kn;\
                            } else {                                                                \
                                for (i64 p = 0; p < P; p++)                                         \
                                    acc[p] = acc[p] + (bx[r][p] * kpn + gx[r][p] * kn);             \
                            }                                                                       \
                        }                                                                           \
                        for (i64 p = 0; p < P; p++) st[n][p] = st[n][p] * al + acc[p];              \
                    }                                                                               \
                    for (i64 r = 0; r < R; r++) {                                                   \
                        const T *qr = q + (((b * L + t) * R + r) * H + h) * N;                      \
                        const T *xrr = xr + (((b * L + t) * R + r) * H + h) * P;                    \
                        T *yr = y + (((b * L + t) * R + r) * H + h) * P;                            \
                        for (i64 p = 0; p < P; p++) acc[p] = (T)0;                                  \
                        for (i64 n = 0; n < N; n++) {                                               \
                            T qn = qr[n];                                                           \
                            for (i64 p = 0; p < P; p++) acc[p] = acc[p] + st[n][p] * qn;            \
                        }                                                                           \
                        for (i64 p = 0; p < P; p++) yr[p] = acc[p] + D[h] * xrr[p];                 \
                        memcpy(kp + ((b * R + r) * H + h) * N, k + (((b * L + t) * R + r) * H + h) * N, \
                               (size_t)N * sizeof(T));                                              \
                        memcpy(xp + ((b * R + r) * H + h) * P, xrr, (size_t)P * sizeof(T));         \
                    }                                                                               \
                }                                                                                   \
                for (i64 p = 0; p < P; p++)                                                         \
                    for (i64 n = 0; n < N; n++) sh[p * N + n] = st[n][p];                           \
            }                                                                                       \
        }                                                                                           \
    }

DEFINE_KERNELS(float, _f32)
DEFINE_KERNELS(double, _f64)

/* --- block-int8 products (weights "q8") ----------------------------------------------------- */

/* Weights in blocks of QB = 32 along k: int8 values q in [-127, 127] and one float16 scale d per
 * block (llama.cpp's Q8_0 layout), k padded with zeros to a multiple of 32: q (N, KP), d (N, NB).
 * Activations are quantized per row and block the same way with a float32 scale:
 *     s = max |x| / 127,   qx = rint(x / s) (ties to even; 0 where s is 0), clamped to [-127, 127],
 * and then
 *     out[m, n] = (((0 + t_0) + t_1) + ... + t_{NB-1}) [+ bias[n]],
 *     t_b = (float)isum_b * (s_b * d_b),   isum_b = sum_j qx[m, b, j] q[n, b, j].
 * isum_b is an integer below 2^24 in magnitude, exact in any order and exactly a float: the
 * instruction set only decides how fast it is found. The float operations, and the order of the
 * blocks, are the same for every output. */
#define QB 32

/* rint for |v| < 2^22: the sum lands where floats are integers */
static inline float rint_small(float v) {
    const float r = 12582912.0f; /* 1.5 * 2^23 */
    return (v + r) - r;
}

void quantize_rows_q8(const float *x, i64 M, i64 K, int8_t *qx, float *sx) {
    i64 nb = (K + QB - 1) / QB, kp = nb * QB;
    for (i64 m = 0; m < M; m++)
        for (i64 b = 0; b < nb; b++) {
            const float *xb = x + m * K + b * QB;
            i64 len = K - b * QB < QB ? K - b * QB : QB;
            float amax = 0.0f;
            for (i64 j = 0; j < len; j++) {
                float a = xb[j] < 0.0f ? -xb[j] : xb[j];
                amax = a > amax || a != a ? a : amax; /* a NaN stays */
            }
            float s = amax / 127.0f;
            /* a non-finite activation makes the block's scale NaN and its values 0: every output
             * it reaches is NaN, never an integer cast of one */
            int finite = s - s == 0.0f;
            s = finite ? s : NAN;
            int8_t *qb = qx + m * kp + b * QB;
            for (i64 j = 0; j < QB; j++) {
                float v = j < len && s != 0.0f && finite ? rint_small(xb[j] / s) : 0.0f;
                v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
                qb[j] = (int8_t)v;
            }
            sx[m * nb + b] = s;
        }
}

static inline int32_t dot_q8(const int8_t *a, const int8_t *b) {
    int32_t s = 0;
    for (int j = 0; j < QB; j++) s += (int32_t)a[j] * (int32_t)b[j];
    return s;
}

#if defined(__AVX2__)
#include <immintrin.h>
/* the 8 lanes of 8 vectors of int32 partial sums, each vector's total in its lane */
static inline __m256i sum8_epi32(__m256i v0, __m256i v1, __m256i v2, __m256i v3, __m256i v4, __m256i v5,
                                 __m256i v6, __m256i v7) {
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v4, v5), _mm256_hadd_epi32(v6, v7));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* the 32 products of a block in 8 int32 partial sums: exact however they are grouped */
static inline __m256i dot_q8_avx2(__m256i ax, __m256i x, const int8_t *w) {
    __m256i wv = _mm256_loadu_si256((const __m256i *)w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* |x| (<= 127) * +-w, four products to an int32 in one instruction */
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, _mm256_sign_epi8(wv, x));
#else
    __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, x)); /* |x| (<= 127) * +-w: no saturation */
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

/* the scales of outputs n .. n + 7 for block b, from d8: the scales repacked (N / 8, NB, 8) */
static inline __m256 scales8(const uint16_t *d8, i64 nb, i64 n, i64 b) {
    const uint16_t *p = d8 + ((n / 8) * nb + b) * 8;
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
    float dn[8];
    for (int i = 0; i < 8; i++) dn[i] = f16_to_float(p[i]);
    return _mm256_loadu_ps(dn);
#endif
}

/* one block's term added to an output's sum: acc + isum * c, rounded twice (exact-1) or once
 * (exact-2: fused), 8 outputs at a time or one */
#define Q8_SPLIT8(a, c, acc) _mm256_add_ps(acc, _mm256_mul_ps(a, c))
#if defined(__FMA__)
#define Q8_FUSED8(a, c, acc) _mm256_fmadd_ps(a, c, acc)
#else
static inline __m256 q8_fused8(__m256 a, __m256 c, __m256 acc) {
    float x[8], y[8], z[8];
    _mm256_storeu_ps(x, a);
    _mm256_storeu_ps(y, c);
    _mm256_storeu_ps(z, acc);
    for (int i = 0; i < 8; i++) z[i] = fmaf(x[i], y[i], z[i]);
    return _mm256_loadu_ps(z);
}
#define Q8_FUSED8(a, c, acc) q8_fused8(a, c, acc)
#endif

/* the 8-output tile of linear_q8##AR##_f32: MADD8 adds a block's 8 terms to the 8 sums */
#define DEFINE_Q8_TILE8(AR, MADD8)                                                                  \
    /* outputs n .. n + 7 of row m (n a multiple of 8) */                                           \
    static void tile8_q8##AR(const int8_t *qx, const float *sx, i64 nb, const int8_t *q, const uint16_t *d8, \
                             i64 n, i64 N, float *out) {                                            \
        i64 kp = nb * QB;                                                                           \
        __m256 acc = _mm256_setzero_ps();                                                           \
        const int8_t *next = q + (n + 8) * kp; /* the next tile's rows, fetched ahead (tile##WN's reason) */ \
        int more = n + 16 <= N;                                                                     \
        for (i64 b = 0; b < nb; b++) {                                                              \
            if (more && (b & 1) == 0)                                                               \
                for (int i = 0; i < 8; i++) __builtin_prefetch(next + i * kp + b * QB, 0, PREFETCH_LOCALITY); \
            __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + b * QB));                       \
            __m256i ax = _mm256_sign_epi8(xv, xv);                                                  \
            const int8_t *w = q + n * kp + b * QB;                                                  \
            __m256i s = sum8_epi32(dot_q8_avx2(ax, xv, w), dot_q8_avx2(ax, xv, w + kp),             \
                                   dot_q8_avx2(ax, xv, w + 2 * kp), dot_q8_avx2(ax, xv, w + 3 * kp), \
                                   dot_q8_avx2(ax, xv, w + 4 * kp), dot_q8_avx2(ax, xv, w + 5 * kp), \
                                   dot_q8_avx2(ax, xv, w + 6 * kp), dot_q8_avx2(ax, xv, w + 7 * kp)); \
            __m256 c = _mm256_mul_ps(_mm256_set1_ps(sx[b]), scales8(d8, nb, n, b));                \
            acc = MADD8(_mm256_cvtepi32_ps(s), c, acc);                                             \
        }                                                                                           \
        _mm256_storeu_ps(out + n, acc);                                                             \
    }
DEFINE_Q8_TILE8(, Q8_SPLIT8)
DEFINE_Q8_TILE8(_fma, Q8_FUSED8)
#define Q8_TILES(AR) for (; n + 8 <= b1; n += 8) tile8_q8##AR(xr, sr, nb, q, d8, n, N, orow);
#else
#define Q8_TILES(AR)
#endif

/* linear_q8_f32 (exact-1) and linear_q8_fma_f32 (exact-2): the same blocks, sums and order; only
 * how a block's term joins the sum differs (MADD8 in the tiles, MADD1 for one output) */
#define DEFINE_Q8_LINEAR(AR, MADD1)                                                                 \
    static void one_q8##AR(const int8_t *qx, const float *sx, i64 nb, const int8_t *q, const uint16_t *d, i64 n, \
                           float *out) {                                                            \
        i64 kp = nb * QB;                                                                           \
        float acc = 0.0f;                                                                           \
        for (i64 b = 0; b < nb; b++) {                                                              \
            float c = sx[b] * f16_to_float(d[n * nb + b]);                                          \
            acc = MADD1((float)dot_q8(qx + b * QB, q + n * kp + b * QB), c, acc);                   \
        }                                                                                           \
        out[n] = acc;                                                                               \
    }                                                                                               \
    /* out (M, N) = the rows qx (M, KP), sx (M, NB) (quantize_rows_q8) against q, d, for outputs  \
     * [n0, n1) (n0 a multiple of 8); in blocks of BLOCK_N outputs whose weights stay in cache     \
     * while every row passes. d8: the same scales, repacked (ceil(N / 8), NB, 8) for the          \
     * 8-output tiles. */                                                                           \
    void linear_q8##AR##_f32(const int8_t *qx, const float *sx, i64 M, i64 K, const int8_t *q, const uint16_t *d, \
                             const uint16_t *d8, i64 N, const float *bias, float *out, i64 n0, i64 n1) { \
        i64 nb = (K + QB - 1) / QB, kp = nb * QB;                                                   \
        for (i64 b0 = n0; b0 < n1; b0 += BLOCK_N) {                                                 \
            i64 b1 = b0 + BLOCK_N < n1 ? b0 + BLOCK_N : n1;                                         \
            for (i64 m = 0; m < M; m++) {                                                           \
                const int8_t *xr = qx + m * kp;                                                     \
                const float *sr = sx + m * nb;                                                      \
                float *orow = out + m * N;                                                          \
                i64 n = b0;                                                                         \
                Q8_TILES(AR)                                                                        \
                for (; n < b1; n++) one_q8##AR(xr, sr, nb, q, d, n, orow);                          \
                if (bias)                                                                           \
                    for (i64 j = b0; j < b1; j++) orow[j] = orow[j] + bias[j];                      \
            }                                                                                       \
        }                                                                                           \
    }
#define Q8_SPLIT1(a, c, acc) ((acc) + (a) * (c))
#define Q8_FUSED1(a, c, acc) fmaf(a, c, acc)
DEFINE_Q8_LINEAR(, Q8_SPLIT1)
DEFINE_Q8_LINEAR(_fma, Q8_FUSED1)

/* --- the products on several threads ------------------------------------------------------- */
/* A job (a product, a scan) is cut into parts of contiguous work units (runs of 16 outputs,
 * blocks of channels); each unit is computed whole by one thread, so how the parts fall changes
 * no bit. The calling thread and up to POOL_MAX - 1 helper threads claim parts one at a time
 * from one atomic word (generation, parts, next part): a helper that the OS has not run yet
 * claims nothing, and the caller computes what is left itself, so a loaded machine never waits
 * on a thread that is not running. Helpers spin for a while between jobs (a decode step hands
 * them a product every 50-500 us, and waking a sleeping thread costs about as much as a small
 * product), yielding the core now and then, then sleep on a condition variable. Python's thread
 * pool cost 0.1-0.4 ms a hand-off on a 2-core VM, more than half a decode product gains from the
 * second core. One job at a time: a second caller that finds the pool busy computes its whole
 * job on its own thread. */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>

#define POOL_MAX 64
#define POOL_SPIN 20000 /* pause loops before a helper sleeps: about 100-400 us */

typedef void (*part_fn)(const void *job, i64 u0, i64 u1); /* work units [u0, u1) of a job */

static struct {
    pthread_mutex_t job_lock;   /* held by the caller whose job is out */
    pthread_mutex_t sleep_lock; /* guards the sleep below */
    pthread_cond_t wake;
    /* generation << 32 | parts << 16 | next part to claim; a new generation per job */
    atomic_uint_fast64_t claim;
    atomic_int done;     /* parts of this job finished */
    atomic_int sleepers; /* helpers on the condition variable, or about to be */
    int started;         /* helpers running */
    part_fn fn;
    const void *job;
    i64 units;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and compute parts of generation `gen` until none is left. */
static void pool_work(uint64_t gen) {
    uint64_t c = atomic_load_explicit(&pool.claim, memory_order_acquire);
    for (;;) {
        uint64_t parts = (c >> 16) & 0xffff, next = c & 0xffff;
        if (c >> 32 != gen || next >= parts) return;
        if (!atomic_compare_exchange_weak_explicit(&pool.claim, &c, c + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        /* the part is ours: the caller waits for it, so the job's fields stay this job's */
        i64 u0 = pool.units * (i64)next / (i64)parts, u1 = pool.units * (i64)(next + 1) / (i64)parts;
        if (u0 < u1) pool.fn(pool.job, u0, u1);
        atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
        c = atomic_load_explicit(&pool.claim, memory_order_acquire);
    }
}

static void *pool_helper(void *arg) {
    (void)arg;
    uint64_t seen = atomic_load(&pool.claim) >> 32;
    for (;;) {
        uint64_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool.claim, memory_order_acquire) >> 32) == seen && spins < POOL_SPIN) {
            cpu_relax();
            if (++spins % 256 == 0) sched_yield(); /* a loaded machine gets the core back */
        }
        if (g == seen) {
            atomic_fetch_add(&pool.sleepers, 1);
            pthread_mutex_lock(&pool.sleep_lock);
            while ((g = atomic_load(&pool.claim) >> 32) == seen) pthread_cond_wait(&pool.wake, &pool.sleep_lock);
            pthread_mutex_unlock(&pool.sleep_lock);
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        seen = g;
        pool_work(g);
    }
    return NULL;
}

static void pool_after_fork(void) { /* the child has none of the parent's helper threads */
    pthread_mutex_init(&pool.job_lock, NULL);
    pthread_mutex_init(&pool.sleep_lock, NULL);
    pthread_cond_init(&pool.wake, NULL);
    atomic_store(&pool.sleepers, 0);
    pool.started = 0;
}

/* Start helpers until `threads` - 1 run (fewer if the OS refuses one). */
static void pool_grow(int threads) {
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, pool_after_fork);
        registered = 1;
    }
    while (pool.started < threads - 1 && pool.started < POOL_MAX - 1) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, pool_helper, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        pool.started++;
    }
}

/* fn(job, u0, u1) over the work units [0, units), in up to `threads` contiguous parts. */
static void pool_run(part_fn fn, const void *job, i64 units, int threads) {
    if (threads > units) threads = (int)units;
    if (threads > POOL_MAX) threads = POOL_MAX;
    if (threads <= 1 || pthread_mutex_trylock(&pool.job_lock) != 0) {
        fn(job, 0, units);
        return;
    }
    pool_grow(threads);
    pool.fn = fn;
    pool.job = job;
    pool.units = units;
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    uint64_t gen = (atomic_load(&pool.claim) >> 32) + 1;
    atomic_store_explicit(&pool.claim, (gen & 0xffffffffu) << 32 | (uint64_t)threads << 16, memory_order_seq_cst);
    if (atomic_load(&pool.sleepers) > 0) {
        pthread_mutex_lock(&pool.sleep_lock);
        pthread_cond_broadcast(&pool.wake);
        pthread_mutex_unlock(&pool.sleep_lock);
    }
    pool_work(gen & 0xffffffffu);
    for (int spins = 0; atomic_load_explicit(&pool.done, memory_order_acquire) < threads;)
        if (++spins % 256 == 0) sched_yield(); /* a helper computing a part, off the CPU */
        else cpu_relax();
    pthread_mutex_unlock(&pool.job_lock);
}

typedef void (*linear_fn)(const void *x, i64 M, i64 K, const void *w, i64 N, const void *bias, void *out, i64 n0,
                          i64 n1);
struct linear_job {
    linear_fn fn;
    const void *x, *w, *bias;
    void *out;
    i64 M, K, N;
};
/* units of 16 outputs: each thread reads its own weight rows */
static void linear_part(const void *p, i64 u0, i64 u1) {
    const struct linear_job *j = p;
    j->fn(j->x, j->M, j->K, j->w, j->N, j->bias, j->out, u0 * 16, u1 * 16 < j->N ? u1 * 16 : j->N);
}

/* fn (one of the linear_* kernels) over all N outputs, on up to `threads` threads */
void linear_threads(void *fn, const void *x, i64 M, i64 K, const void *w, i64 N, const void *bias, void *out,
                    int threads) {
    struct linear_job j = {(linear_fn)fn, x, w, bias, out, M, K, N};
    pool_run(linear_part, &j, (N + 15) / 16, threads);
}

typedef void (*q8_fn)(const int8_t *qx, const float *sx, i64 M, i64 K, const int8_t *q, const uint16_t *d,
                      const uint16_t *d8, i64 N, const float *bias, float *out, i64 n0, i64 n1);
struct q8_job {
    q8_fn fn;
    const int8_t *qx, *q;
    const float *sx, *bias;
    const uint16_t *d, *d8;
    float *out;
    i64 M, K, N;
};
static void q8_part(const void *p, i64 u0, i64 u1) {
    const struct q8_job *j = p;
    j->fn(j->qx, j->sx, j->M, j->K, j->q, j->d, j->d8, j->N, j->bias, j->out, u0 * 16,
          u1 * 16 < j->N ? u1 * 16 : j->N);
}

/* fn (linear_q8_f32 or linear_q8_fma_f32) over all N outputs, on up to `threads` threads */
void linear_q8_threads(void *fn, const int8_t *qx, const float *sx, i64 M, i64 K, const int8_t *q, const uint16_t *d,
                       const uint16_t *d8, i64 N, const float *bias, float *out, int threads) {
    struct q8_job j = {(q8_fn)fn, qx, q, sx, bias, d, d8, out, M, K, N};
    pool_run(q8_part, &j, (N + 15) / 16, threads);
}

/* --- elementwise functions of a prefill, on the pool ------------------------------------------ */
struct unary_job {
    const void *x;
    void *out;
    i64 n;
    int op;
};
enum { UNARY_UNIT = 4096 }; /* elements a work unit: each thread's part a run of whole units */
#define DEFINE_UNARY_THREADS(T, SUF)                                                                \
    static void unary_part##SUF(const void *p, i64 u0, i64 u1) {                                    \
        const struct unary_job *j = p;                                                              \
        i64 a = u0 * UNARY_UNIT, b = u1 * UNARY_UNIT < j->n ? u1 * UNARY_UNIT : j->n;               \
        unary##SUF((const T *)j->x + a, (T *)j->out + a, b - a, j->op);                             \
    }                                                                                               \
    /* unary##SUF on up to `threads` threads: each value is its own function of its input */       \
    void unary_threads##SUF(const T *x, T *out, i64 n, int op, int threads) {                       \
        struct unary_job j = {x, out, n, op};                                                       \
        pool_run(unary_part##SUF, &j, (n + UNARY_UNIT - 1) / UNARY_UNIT, threads);                  \
    }
DEFINE_UNARY_THREADS(float, _f32)
DEFINE_UNARY_THREADS(double, _f64)

/* --- the causal conv of a prefill, on the pool ------------------------------------------------ */
/* conv_f32 / conv_f64 over a chunk of L tokens with the same operations on the same values (each
 * output's taps summed in the same order, then its bias), laid out for speed: the taps transposed
 * to (W, C), so the channels of one token are the inner, vectorized loop, and the tokens split
 * between threads. conv_f32's own loop (taps innermost) stays the decode step's: one token, no
 * transposition to pay for. */
struct conv_job {
    const void *state, *xs, *wt, *bias;
    void *out;
    i64 L, C, W;
};
#define DEFINE_CONV_THREADS(T, SUF)                                                                 \
    static void conv_part##SUF(const void *p, i64 u0, i64 u1) {                                     \
        const struct conv_job *j = p;                                                               \
        const T *state = j->state, *xs = j->xs, *wt = j->wt, *bias = j->bias;                       \
        T *out = j->out;                                                                            \
        i64 L = j->L, C = j->C, W = j->W;                                                           \
        for (i64 u = u0; u < u1; u++) { /* u = b * L + t */                                         \
            i64 b = u / L, t = u % L;                                                               \
            T *o = out + u * C;                                                                     \
            for (i64 k = 0; k < W; k++) {                                                           \
                i64 i = t + 1 + k; /* position in [state, xs] */                                    \
                const T *wk = wt + k * C;                                                           \
                if (i < W) {                                                                        \
                    const T *f = state + b * C * W + i;                                             \
                    if (k == 0)                                                                     \
                        for (i64 c = 0; c < C; c++) o[c] = f[c * W] * wk[c];                        \
                    else                                                                            \
                        for (i64 c = 0; c < C; c++) o[c] = o[c] + f[c * W] * wk[c];                 \
                } else {                                                                            \
                    const T *f = xs + (b * L + i - W) * C;                                          \
                    if (k == 0)                                                                     \
                        for (i64 c = 0; c < C; c++) o[c] = f[c] * wk[c];                            \
                    else                                                                            \
                        for (i64 c = 0; c < C; c++) o[c] = o[c] + f[c] * wk[c];                     \
                }                                                                                   \
            }                                                                                       \
            if (bias)                                                                               \
                for (i64 c = 0; c < C; c++) o[c] = o[c] + bias[c];                                  \
        }                                                                                           \
    }                                                                                               \
    /* conv##SUF's arguments, on up to `threads` threads (new_state may be state) */                \
    void conv_threads##SUF(const T *state, const T *xs, const T *w, const T *bias, T *out,          \
                           T *new_state, i64 B, i64 L, i64 C, i64 W, int threads) {                 \
        /* a decode step's few tokens on one thread: not worth transposing the taps */             \
        T *wt = threads <= 1 && B * L <= W ? NULL : malloc(sizeof(T) * (size_t)(W * C));            \
        if (wt == NULL || L == 0 || W == 0) {                                                       \
            free(wt);                                                                               \
            conv##SUF(state, xs, w, bias, out, new_state, B, L, C, W);                              \
            return;                                                                                 \
        }                                                                                           \
        for (i64 c = 0; c < C; c++)                                                                 \
            for (i64 k = 0; k < W; k++) wt[k * C + c] = w[c * W + k];                               \
        struct conv_job j = {state, xs, wt, bias, out, L, C, W};                                    \
        pool_run(conv_part##SUF, &j, B * L, threads);                                               \
        free(wt);                                                                                   \
        conv_state##SUF(state, xs, new_state, B, L, C, W);                                          \
    }
DEFINE_CONV_THREADS(float, _f32)
DEFINE_CONV_THREADS(double, _f64)

/* --- a Mamba-1 layer's decode step in one call ----------------------------------------------- */
/* The mixer of scan/_mamba1.py (`Mamba1Mixer.forward`) for one token of B streams, computed by
 * the kernels above in the order the primitives compute it there: the same operations on the
 * same values, so the same bits (tests/scan/test_exact.py holds it to the primitives' path; the
 * load-time probe checks it on the model). One call instead of about twelve: a decode step of a
 * 130M model spent half its time between kernels, in Python. */

struct exact_weight { /* a product's weight as held (`Q8Weight` or a tensor), and its bias */
    i64 format;       /* 0 the compute dtype, 1 bfloat16, 2 float16, 3 q8 */
    i64 fused;        /* 1: the exact-2 products (fused multiply-adds), 0: exact-1's */
    const void *w;    /* formats 0-2: (N, K) */
    const int8_t *q;  /* q8: (N, KP) blocks, d (N, NB) and d8 their scales */
    const uint16_t *d, *d8;
    const float *bias; /* (N,) or NULL */
    i64 n, k;
};

struct mamba1_layer {
    struct exact_weight in_proj, x_proj, dt_proj, out_proj;
    const float *conv_taps; /* (C, W) */
    const float *conv_bias; /* (C,) or NULL */
    const float *at;        /* (N, C): A = -exp(A_log), transposed */
    const float *dskip;     /* (C,): D */
    i64 c, n, r, w;
    i64 threaded_work; /* products of at least this many multiply-adds go to the pool */
    i64 threads;
};

/* out (M, N) = x (M, K) against the weight, as `_Kernels.linear` computes it (on `threads`
 * threads from `threaded_work` multiply-adds). qx, sx: room for the quantized rows (M, KP) and
 * their scales (M, NB). */
static void exact_product(const struct exact_weight *W, const float *x, i64 M, float *out, int8_t *qx, float *sx,
                          i64 threaded_work, i64 threads) {
    int t = M * W->k * W->n >= threaded_work ? (int)threads : 1;
    if (W->format == 3) {
        quantize_rows_q8(x, M, W->k, qx, sx);
        linear_q8_threads(W->fused ? (void *)linear_q8_fma_f32 : (void *)linear_q8_f32, qx, sx, M, W->k, W->q, W->d,
                          W->d8, W->n, W->bias, out, t);
        return;
    }
    void *fn = W->fused ? (W->format == 1   ? (void *)linear_fma_bf16_f32
                           : W->format == 2 ? (void *)linear_fma_f16_f32
                                            : (void *)linear_fma_same_f32)
                        : (W->format == 1   ? (void *)linear_bf16_f32
                           : W->format == 2 ? (void *)linear_f16_f32
                                            : (void *)linear_same_f32);
    linear_threads(fn, x, M, W->k, W->w, W->n, W->bias, out, t);
}

struct scan_job {
    const float *dt, *at, *x, *bm, *cm, *h0;
    float *h, *y;
    i64 B, C, N;
};
static void scan_part(const void *p, i64 u0, i64 u1) {
    const struct scan_job *j = p;
    selective_scan_f32(j->dt, j->at, j->x, j->bm, j->cm, j->h0, j->h, j->y, j->B, 1, j->C, j->N, u0, u1);
}

/* u (B, D) -> out (B, D); conv_in / conv_out (B, C, W) and h_in / h_out (B, C, N) the states
 * before and after (each pair may be one buffer: the kernels read a stream's block before they
 * write it). work: float scratch of `mamba1_step_work` floats. */
i64 mamba1_step_work(const struct mamba1_layer *L, i64 B) {
    i64 c = L->c, kmax = L->in_proj.k > c ? L->in_proj.k : c;
    i64 nb = (kmax + QB - 1) / QB;
    /* xz 2C, x C, xc C, x_dbl R+2N, dt_r R, dt C, bm N, cm N, y C, z C, qx nb*QB/4, sx nb */
    return B * (9 * c + 2 * L->r + 4 * L->n + nb * QB / 4 + nb + 16);
}

void mamba1_step_f32(const struct mamba1_layer *L, const float *u, i64 B, const float *conv_in, float *conv_out,
                     const float *h_in, float *h_out, float *out, float *work) {
    i64 c = L->c, n = L->n, r = L->r, xd = r + 2 * n;
    i64 kmax = L->in_proj.k > c ? L->in_proj.k : c, nb = (kmax + QB - 1) / QB;
    float *xz = work, *x = xz + B * 2 * c, *xc = x + B * c, *xdbl = xc + B * c, *dtr = xdbl + B * xd;
    float *dt = dtr + B * r, *bm = dt + B * c, *cm = bm + B * n, *y = cm + B * n, *z = y + B * c;
    float *sx = z + B * c;
    int8_t *qx = (int8_t *)(sx + B * nb);
    exact_product(&L->in_proj, u, B, xz, qx, sx, L->threaded_work, L->threads); /* xz = in_proj(u) */
    for (i64 b = 0; b < B; b++) {                     /* x, z = xz[..., :C], xz[..., C:] */
        memcpy(x + b * c, xz + b * 2 * c, c * sizeof(float));
        memcpy(z + b * c, xz + b * 2 * c + c, c * sizeof(float));
    }
    conv_f32(conv_in, x, L->conv_taps, L->conv_bias, xc, conv_out, B, 1, c, L->w);
    unary_f32(xc, xc, B * c, 1);                                 /* xc = silu(conv) */
    exact_product(&L->x_proj, xc, B, xdbl, qx, sx, L->threaded_work, L->threads);           /* x_dbl */
    for (i64 b = 0; b < B; b++) {                                /* dt_r, B, C of x_dbl */
        memcpy(dtr + b * r, xdbl + b * xd, r * sizeof(float));
        memcpy(bm + b * n, xdbl + b * xd + r, n * sizeof(float));
        memcpy(cm + b * n, xdbl + b * xd + r + n, n * sizeof(float));
    }
    exact_product(&L->dt_proj, dtr, B, dt, qx, sx, L->threaded_work, L->threads);
    unary_f32(dt, dt, B * c, 3);                                 /* dt = softplus(dt_proj(dt_r)) */
    i64 nblk = (c + 63) / 64;
    struct scan_job sj = {dt, L->at, xc, bm, cm, h_in, h_out, y, B, c, n};
    /* an exp in double (about 30 operations) per channel and state: worth two threads sooner than a product */
    pool_run(scan_part, &sj, B * nblk, B * c * n * 32 >= L->threaded_work ? (int)L->threads : 1);
    unary_f32(z, z, B * c, 1);                                   /* silu(z) */
    for (i64 b = 0; b < B; b++)                                  /* (y + D xc) silu(z) */
        for (i64 j = 0; j < c; j++) {
            float v = y[b * c + j] + L->dskip[j] * xc[b * c + j];
            y[b * c + j] = v * z[b * c + j];
        }
    exact_product(&L->out_proj, y, B, out, qx, sx, L->threaded_work, L->threads);
}

/* --- a Mamba-2 layer's decode step in one call ----------------------------------------------- */
/* `Mamba2Mixer.forward` of scan/_mamba2.py for one token of B streams, as the primitives compute
 * it, for the layout mamba-ssm's Mamba2 uses: no gated-MLP part (d_inner = d_ssm), the gated
 * RMSNorm, dt unclamped. Other layouts run the primitives. */

struct mamba2_layer {
    struct exact_weight in_proj, out_proj;
    const float *conv_taps; /* (CD, W), CD = E + 2 G N */
    const float *conv_bias; /* (CD,) or NULL */
    const float *dt_bias;   /* (H,) */
    const float *a;         /* (H,): A = -exp(A_log) */
    const float *dskip;     /* D: (H,) or (H, P) */
    const float *norm_w;    /* (E,) */
    double norm_eps;
    i64 e, h, p, g, n, w;
    i64 d_per_channel; /* D holds (H, P) values, not one per head */
    i64 norm_before_gate;
    i64 threaded_work, threads;
};

struct ssd_job {
    const float *x, *dt, *a, *bm, *cm, *s0;
    float *s, *y;
    i64 B, H, P, G, N;
};
static void ssd_part(const void *p, i64 u0, i64 u1) {
    const struct ssd_job *j = p;
    ssd_scan_f32(j->x, j->dt, j->a, j->bm, j->cm, j->s0, j->s, j->y, j->B, 1, j->H, j->P, j->G, j->N, u0, u1);
}

i64 mamba2_step_work(const struct mamba2_layer *L, i64 B) {
    i64 cd = L->e + 2 * L->g * L->n, width = 2 * L->e + 2 * L->g * L->n + L->h;
    i64 kmax = L->in_proj.k > L->e ? L->in_proj.k : L->e, nb = (kmax + QB - 1) / QB;
    /* zxbcdt, xbc, xbc after the conv, z, dt, y, the normed y, qx, sx */
    return B * (width + 2 * cd + 3 * L->e + L->h + nb * QB / 4 + nb + 16);
}

void mamba2_step_f32(const struct mamba2_layer *L, const float *u, i64 B, const float *conv_in, float *conv_out,
                     const float *s_in, float *s_out, float *out, float *work) {
    i64 e = L->e, h = L->h, p = L->p, g = L->g, n = L->n, cd = e + 2 * g * n, width = e + cd + h;
    i64 kmax = L->in_proj.k > e ? L->in_proj.k : e, nb = (kmax + QB - 1) / QB;
    float *zx = work, *xbc = zx + B * width, *xc = xbc + B * cd, *z = xc + B * cd, *dt = z + B * e;
    float *y = dt + B * h, *yn = y + B * e, *sx = yn + B * e;
    int8_t *qx = (int8_t *)(sx + B * nb);
    exact_product(&L->in_proj, u, B, zx, qx, sx, L->threaded_work, L->threads);
    for (i64 b = 0; b < B; b++) { /* z, xBC, dt = split(in_proj(u)) */
        memcpy(z + b * e, zx + b * width, e * sizeof(float));
        memcpy(xbc + b * cd, zx + b * width + e, cd * sizeof(float));
        for (i64 j = 0; j < h; j++) dt[b * h + j] = zx[b * width + e + cd + j] + L->dt_bias[j];
    }
    conv_f32(conv_in, xbc, L->conv_taps, L->conv_bias, xc, conv_out, B, 1, cd, L->w);
    unary_f32(xc, xc, B * cd, 1); /* silu */
    unary_f32(dt, dt, B * h, 3);  /* softplus(dt + dt_bias) */
    /* x, B, C of xBC, contiguous: x (B, H, P) is the row's head, B and C (B, G, N) follow it */
    float *xs = xbc, *bs = xbc + B * e, *cs = bs + B * g * n; /* xbc is free again: reuse it */
    for (i64 b = 0; b < B; b++) {
        memcpy(xs + b * e, xc + b * cd, e * sizeof(float));
        memcpy(bs + b * g * n, xc + b * cd + e, g * n * sizeof(float));
        memcpy(cs + b * g * n, xc + b * cd + e + g * n, g * n * sizeof(float));
    }
    struct ssd_job sj = {xs, dt, L->a, bs, cs, s_in, s_out, y, B, h, p, g, n};
    pool_run(ssd_part, &sj, B * h, B * h * p * n * 32 >= L->threaded_work ? (int)L->threads : 1);
    for (i64 b = 0; b < B; b++) /* y + D x */
        for (i64 j = 0; j < e; j++) {
            float d = L->d_per_channel ? L->dskip[j] : L->dskip[j / p];
            y[b * e + j] = y[b * e + j] + d * xs[b * e + j];
        }
    gated_norm_f32(y, z, L->norm_w, yn, B, e, e / g, L->norm_eps, (int)L->norm_before_gate);
    exact_product(&L->out_proj, yn, B, out, qx, sx, L->threaded_work, L->threads);
}
