/* The scans: Mamba-1's selective scan, Mamba-2's SSD, Mamba-3's angles and trapezoid.
 *
 * A part of the exact kernels, not compiled on its own: `_kernels.c` includes it, with the
 * others, into one translation unit (so each kernel compiles as it did in a single file).
 *
 * Their twins, `selective_scan_twin`, `ssd_twin`, `angle_twin` and `trapezoid_twin` (and the
 * `_into` ones), are in `_scans.py`, beside the kernel calls. */

#define DEFINE_SCANS(T, SUF)                                                                        \
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

DEFINE_SCANS(float, _f32)
DEFINE_SCANS(double, _f64)
