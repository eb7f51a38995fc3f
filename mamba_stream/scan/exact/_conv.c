/* The causal depthwise conv over a chunk: a decode step's, and a prefill's on the pool.
 *
 * A part of the exact kernels, not compiled on its own: `_kernels.c` includes it, with the
 * others, into one translation unit (so each kernel compiles as it did in a single file).
 *
 * Its twins, `conv_twin` and `conv_into_twin`, are in `_conv.py`, beside the kernel calls. */

#define DEFINE_CONV(T, SUF)                                                                         \
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
    }

DEFINE_CONV(float, _f32)
DEFINE_CONV(double, _f64)

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
