/* The norms: the mean of rows, RMSNorm and mamba-ssm's gated RMSNorm.
 *
 * A part of the exact kernels, not compiled on its own: `_kernels.c` includes it, with the
 * others, into one translation unit (so each kernel compiles as it did in a single file).
 *
 * Their twins, `mean_twin`, `norm_twin` and `gated_norm_twin`, are in `_norms.py`, beside
 * the kernel calls. */

#define DEFINE_NORMS(T, SUF)                                                                        \
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
    /* out[r] = (((0 + x[r,0]) + x[r,1]) + ...) / D: the mean of each row, summed in order. */      \
    void mean_rows##SUF(const T *x, T *out, i64 rows, i64 d) {                                      \
        for (i64 r = 0; r < rows; r++) {                                                            \
            const T *p = x + r * d;                                                                 \
            T s = (T)0;                                                                             \
            for (i64 j = 0; j < d; j++) s = s + p[j];                                               \
            out[r] = s / (T)d;                                                                      \
        }                                                                                           \
    }

DEFINE_NORMS(float, _f32)
DEFINE_NORMS(double, _f64)

/* --- the norms of a prefill, on the pool ------------------------------------------------------ */
/* Rows split between threads: each row is normed whole by one thread, as on one, so the same bits
 * (a 512-token Mamba-2 prefill spent 7% of its time in the gated norm's silu on one core). */
struct norm_job {
    const void *x, *z, *w;
    void *y;
    i64 d, gs;
    double eps;
    int before;
};
#define DEFINE_NORM_THREADS(T, SUF)                                                                 \
    static void rms_part##SUF(const void *p, i64 r0, i64 r1) {                                      \
        const struct norm_job *j = p;                                                               \
        rms_norm##SUF((const T *)j->x + r0 * j->d, (const T *)j->w, (T *)j->y + r0 * j->d, r1 - r0, j->d, j->eps); \
    }                                                                                               \
    static void gated_part##SUF(const void *p, i64 r0, i64 r1) {                                    \
        const struct norm_job *j = p;                                                               \
        gated_norm##SUF((const T *)j->x + r0 * j->d, (const T *)j->z + r0 * j->d, (const T *)j->w,  \
                        (T *)j->y + r0 * j->d, r1 - r0, j->d, j->gs, j->eps, j->before);            \
    }                                                                                               \
    void rms_norm_threads##SUF(const T *x, const T *w, T *y, i64 rows, i64 d, double eps, int threads) { \
        struct norm_job j = {x, NULL, w, y, d, 0, eps, 0};                                          \
        pool_run(rms_part##SUF, &j, rows, threads);                                                 \
    }                                                                                               \
    void gated_norm_threads##SUF(const T *x, const T *z, const T *w, T *y, i64 rows, i64 d, i64 gs, \
                                 double eps, int before, int threads) {                             \
        struct norm_job j = {x, z, w, y, d, gs, eps, before};                                       \
        pool_run(gated_part##SUF, &j, rows, threads);                                               \
    }
DEFINE_NORM_THREADS(float, _f32)
DEFINE_NORM_THREADS(double, _f64)
