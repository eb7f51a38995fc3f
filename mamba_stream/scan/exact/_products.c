/* The products: out = x w^T + bias in one fixed order, in every weight format (float,
 * double, bfloat16, float16, block-int8), exact-1 and exact-2, and on the pool.
 *
 * A part of the exact kernels, not compiled on its own: `_kernels.c` includes it, with the
 * others, into one translation unit (so each kernel compiles as it did in a single file).
 *
 * Its twins, `linear_twin` and `linear_fma_twin`, are in `_products.py`, beside the kernel
 * call (the q8 twin in `scan/_quant.py`). */

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

/* the 32 products of a block (x against the weights wv) in 8 int32 partial sums: exact however
 * they are grouped; ax = |x| */
static inline __m256i dot_q8v(__m256i ax, __m256i x, __m256i wv) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    /* |x| (<= 127) * +-w, four products to an int32 in one instruction */
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, _mm256_sign_epi8(wv, x));
#else
    __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, x)); /* |x| (<= 127) * +-w: no saturation */
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}
static inline __m256i dot_q8_avx2(__m256i ax, __m256i x, const int8_t *w) {
    return dot_q8v(ax, x, _mm256_loadu_si256((const __m256i *)w));
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

/* The block sums of four rows against the same 8 outputs, each weight vector loaded once for the
 * four (a prefill's rows): the same integers isum_b (exact in any grouping), the same float steps
 * per row, so tile8's bits. With VNNI the signed rows are read as unsigned bytes x + 128 (x ^ 0x80:
 * x is in [-127, 127]) and 128 sum(w), one product shared by the rows (`q8_shared`), is taken off
 * each block sum: no per-row sign of every weight vector. */
#define Q8_ROWS 4
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __m256i q8_shared(const __m256i *wv) { /* 128 sum(w) of each of the 8 weight rows */
    const __m256i flip = _mm256_set1_epi8((char)0x80), z = _mm256_setzero_si256();
    return sum8_epi32(_mm256_dpbusd_epi32(z, flip, wv[0]), _mm256_dpbusd_epi32(z, flip, wv[1]),
                      _mm256_dpbusd_epi32(z, flip, wv[2]), _mm256_dpbusd_epi32(z, flip, wv[3]),
                      _mm256_dpbusd_epi32(z, flip, wv[4]), _mm256_dpbusd_epi32(z, flip, wv[5]),
                      _mm256_dpbusd_epi32(z, flip, wv[6]), _mm256_dpbusd_epi32(z, flip, wv[7]));
}
static inline __m256i q8_row_sums(__m256i xv, const __m256i *wv, __m256i shared) { /* isum_b of 8 outputs */
    const __m256i xu = _mm256_xor_si256(xv, _mm256_set1_epi8((char)0x80)), z = _mm256_setzero_si256();
    __m256i s = sum8_epi32(_mm256_dpbusd_epi32(z, xu, wv[0]), _mm256_dpbusd_epi32(z, xu, wv[1]),
                           _mm256_dpbusd_epi32(z, xu, wv[2]), _mm256_dpbusd_epi32(z, xu, wv[3]),
                           _mm256_dpbusd_epi32(z, xu, wv[4]), _mm256_dpbusd_epi32(z, xu, wv[5]),
                           _mm256_dpbusd_epi32(z, xu, wv[6]), _mm256_dpbusd_epi32(z, xu, wv[7]));
    return _mm256_sub_epi32(s, shared);
}
#else
static inline __m256i q8_shared(const __m256i *wv) {
    (void)wv;
    return _mm256_setzero_si256();
}
static inline __m256i q8_row_sums(__m256i xv, const __m256i *wv, __m256i shared) {
    (void)shared;
    __m256i ax = _mm256_sign_epi8(xv, xv);
    return sum8_epi32(dot_q8v(ax, xv, wv[0]), dot_q8v(ax, xv, wv[1]), dot_q8v(ax, xv, wv[2]), dot_q8v(ax, xv, wv[3]),
                      dot_q8v(ax, xv, wv[4]), dot_q8v(ax, xv, wv[5]), dot_q8v(ax, xv, wv[6]), dot_q8v(ax, xv, wv[7]));
}
#endif
#define DEFINE_Q8_TILE48(AR, MADD8)                                                                 \
    static void tile48_q8##AR(const int8_t *qx, const float *sx, i64 nb, const int8_t *q, const uint16_t *d8, \
                              i64 n, i64 N, float *out) {                                           \
        i64 kp = nb * QB;                                                                           \
        __m256 acc[Q8_ROWS];                                                                        \
        for (int r = 0; r < Q8_ROWS; r++) acc[r] = _mm256_setzero_ps();                             \
        for (i64 b = 0; b < nb; b++) {                                                              \
            const int8_t *w = q + n * kp + b * QB;                                                  \
            __m256i wv[8];                                                                          \
            for (int i = 0; i < 8; i++) wv[i] = _mm256_loadu_si256((const __m256i *)(w + i * kp));  \
            __m256i shared = q8_shared(wv);                                                         \
            __m256 dn = scales8(d8, nb, n, b);                                                      \
            for (int r = 0; r < Q8_ROWS; r++) {                                                     \
                __m256i xv = _mm256_loadu_si256((const __m256i *)(qx + r * kp + b * QB));           \
                __m256i s = q8_row_sums(xv, wv, shared);                                            \
                __m256 c = _mm256_mul_ps(_mm256_set1_ps(sx[r * nb + b]), dn);                       \
                acc[r] = MADD8(_mm256_cvtepi32_ps(s), c, acc[r]);                                   \
            }                                                                                       \
        }                                                                                           \
        for (int r = 0; r < Q8_ROWS; r++) _mm256_storeu_ps(out + r * N + n, acc[r]);                \
    }
DEFINE_Q8_TILE48(, Q8_SPLIT8)
DEFINE_Q8_TILE48(_fma, Q8_FUSED8)
#define Q8_TILES(AR) for (; n + 8 <= b1; n += 8) tile8_q8##AR(xr, sr, nb, q, d8, n, N, orow);
#define Q8_TILES4(AR) for (; n + 8 <= b1; n += 8) tile48_q8##AR(xr, sr, nb, q, d8, n, N, orow);
#else
#define Q8_TILES(AR)
#define Q8_TILES4(AR)
#endif

/* linear_q8_f32 (exact-1) and linear_q8_fma_f32 (exact-2): the same blocks, sums and order; only
 * how a block's term joins the sum differs (MADD8 in the tiles, MADD1 for one output) */
#define DEFINE_Q8_LINEAR(AR, MADD1)                                                                 \
    /* one output n; its scales read from d8 too (element n % 8 of its tile's run), so that no     \
     * kernel reads d: a checkpoint's d can leave memory once d8 is made (Q8Weight.settle) */        \
    static void one_q8##AR(const int8_t *qx, const float *sx, i64 nb, const int8_t *q, const uint16_t *d8, i64 n, \
                           float *out) {                                                            \
        i64 kp = nb * QB;                                                                           \
        const uint16_t *dn = d8 + (n / 8) * nb * 8 + n % 8;                                         \
        float acc = 0.0f;                                                                           \
        for (i64 b = 0; b < nb; b++) {                                                              \
            float c = sx[b] * f16_to_float(dn[b * 8]);                                              \
            acc = MADD1((float)dot_q8(qx + b * QB, q + n * kp + b * QB), c, acc);                   \
        }                                                                                           \
        out[n] = acc;                                                                               \
    }                                                                                               \
    /* out (M, N) = the rows qx (M, KP), sx (M, NB) (quantize_rows_q8) against q, d, for outputs  \
     * [n0, n1) (n0 a multiple of 8); in blocks of BLOCK_N outputs whose weights stay in cache     \
     * while every row passes. d8: the same scales, repacked (ceil(N / 8), NB, 8) for the          \
     * 8-output tiles, and the only ones read (d is unused, kept in the signature). */             \
    void linear_q8##AR##_f32(const int8_t *qx, const float *sx, i64 M, i64 K, const int8_t *q, const uint16_t *d, \
                             const uint16_t *d8, i64 N, const float *bias, float *out, i64 n0, i64 n1) { \
        i64 nb = (K + QB - 1) / QB, kp = nb * QB;                                                   \
        (void)d;                                                                                    \
        for (i64 b0 = n0; b0 < n1; b0 += BLOCK_N) {                                                 \
            i64 b1 = b0 + BLOCK_N < n1 ? b0 + BLOCK_N : n1;                                         \
            i64 m = 0;                                                                              \
            for (; m + Q8_ROWS <= M; m += Q8_ROWS) { /* four rows at a time; the tail one by one */ \
                const int8_t *xr = qx + m * kp;                                                     \
                const float *sr = sx + m * nb;                                                      \
                float *orow = out + m * N;                                                          \
                i64 n = b0;                                                                         \
                Q8_TILES4(AR)                                                                       \
                for (; n < b1; n++)                                                                 \
                    for (int r = 0; r < Q8_ROWS; r++)                                               \
                        one_q8##AR(xr + r * kp, sr + r * nb, nb, q, d8, n, orow + r * N);           \
                if (bias)                                                                           \
                    for (int r = 0; r < Q8_ROWS; r++)                                               \
                        for (i64 j = b0; j < b1; j++) orow[r * N + j] = orow[r * N + j] + bias[j];  \
            }                                                                                       \
            for (; m < M; m++) {                                                                    \
                const int8_t *xr = qx + m * kp;                                                     \
                const float *sr = sx + m * nb;                                                      \
                float *orow = out + m * N;                                                          \
                i64 n = b0;                                                                         \
                Q8_TILES(AR)                                                                        \
                for (; n < b1; n++) one_q8##AR(xr, sr, nb, q, d8, n, orow);                         \
                if (bias)                                                                           \
                    for (i64 j = b0; j < b1; j++) orow[j] = orow[j] + bias[j];                      \
            }                                                                                       \
        }                                                                                           \
    }
#define Q8_SPLIT1(a, c, acc) ((acc) + (a) * (c))
#define Q8_FUSED1(a, c, acc) fmaf(a, c, acc)
DEFINE_Q8_LINEAR(, Q8_SPLIT1)
DEFINE_Q8_LINEAR(_fma, Q8_FUSED1)

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
