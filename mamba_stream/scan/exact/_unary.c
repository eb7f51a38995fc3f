/* The elementwise functions: exp, silu, sigmoid, softplus, tanh, sin, cos and rsqrt,
 * computed in double from basic operations and rounded to T (`unary`, and on the pool).
 *
 * A part of the exact kernels, not compiled on its own: `_kernels.c` includes it, with the
 * others, into one translation unit (so each kernel compiles as it did in a single file).
 *
 * Its twins, `unary_twin` and `exp_twin`, are in `_unary.py`, beside the kernel calls. */

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

#define DEFINE_UNARY(T, SUF)                                                                        \
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
    }

DEFINE_UNARY(float, _f32)
DEFINE_UNARY(double, _f64)

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
