/* A Mamba-1 or Mamba-2 layer's decode step in one call.
 *
 * A part of the exact kernels, not compiled on its own: `_kernels.c` includes it, with the
 * others, into one translation unit (so each kernel compiles as it did in a single file).
 *
 * No twin of its own: its twin is the primitives' path through the mixer, which
 * tests/scan/exact/test_step.py and the load-time probe hold it to (`_step.py`). */

/* --- a Mamba-1 layer's decode step in one call ----------------------------------------------- */
/* The mixer of scan/_mamba1.py (`Mamba1Mixer.forward`) for one token of B streams, computed by
 * the kernels above in the order the primitives compute it there: the same operations on the
 * same values, so the same bits (tests/scan/exact/test_step.py holds it to the primitives' path;
 * the load-time probe checks it on the model). One call instead of about twelve: a decode step of
 * a 130M model spent half its time between kernels, in Python. */

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

/* --- a whole model's decode step in one call ------------------------------------------------- */
/* `scan._forward.forward` for one token of B streams of a plain Mamba-1 or Mamba-2 model (every
 * layer a one-call mixer behind an RMSNorm without bias, no multipliers), as the loop computes
 * it: residual = hidden (first layer) or hidden + residual, the norm, the mixer's step (above);
 * after the last layer residual = hidden + residual, norm_f, the head's product. The same
 * operations on the same values in the same order, so the loop's bits (tests/scan/exact/test_step.py;
 * the probe's token-by-token check runs it). One call a token instead of a Python loop over the
 * layers: 2-4 ms of a 130M step were Python's. */

struct model_step {
    i64 n_layer, kind; /* kind 1: Mamba-1 layers, 2: Mamba-2 */
    i64 d, vocab;
    const void *const *layers;  /* n_layer struct mamba1_layer or mamba2_layer */
    const float *const *norm_w; /* n_layer (D,): each block's RMSNorm weight */
    const float *normf_w;       /* (D,) */
    double eps;
    struct exact_weight head; /* (V, D) */
    i64 threaded_work, threads;
};

static i64 layer_work(const struct model_step *M, i64 i, i64 B) {
    return M->kind == 1 ? mamba1_step_work((const struct mamba1_layer *)M->layers[i], B)
                        : mamba2_step_work((const struct mamba2_layer *)M->layers[i], B);
}

i64 model_step_work(const struct model_step *M, i64 B) {
    i64 most = 0;
    for (i64 i = 0; i < M->n_layer; i++) {
        i64 w = layer_work(M, i, B);
        most = w > most ? w : most;
    }
    i64 nb = (M->d + QB - 1) / QB;
    /* hidden, residual, normed; the head's quantized row and scales */
    return most + B * (3 * M->d + nb * QB / 4 + nb + 16);
}

/* u (B, D) the embeddings -> logits (B, V); conv_in[i] / conv_out[i], h_in[i] / h_out[i]: layer i's
 * states before and after (pairs may be one buffer, as for the layers' steps) */
void model_step_f32(const struct model_step *M, const float *u, i64 B, float *const *conv_in, float *const *conv_out,
                    float *const *h_in, float *const *h_out, float *logits, float *work) {
    i64 d = M->d, n = B * d, nb = (d + QB - 1) / QB;
    float *hidden = work, *residual = hidden + n, *normed = residual + n, *sx = normed + n;
    int8_t *qx = (int8_t *)(sx + B * nb);
    float *lw = (float *)(qx + B * nb * QB) + 16;
    memcpy(hidden, u, n * sizeof(float));
    for (i64 i = 0; i < M->n_layer; i++) {
        if (i == 0)
            memcpy(residual, hidden, n * sizeof(float));
        else
            for (i64 j = 0; j < n; j++) residual[j] = hidden[j] + residual[j];
        rms_norm_f32(residual, M->norm_w[i], normed, B, d, M->eps);
        if (M->kind == 1)
            mamba1_step_f32((const struct mamba1_layer *)M->layers[i], normed, B, conv_in[i], conv_out[i], h_in[i],
                            h_out[i], hidden, lw);
        else
            mamba2_step_f32((const struct mamba2_layer *)M->layers[i], normed, B, conv_in[i], conv_out[i], h_in[i],
                            h_out[i], hidden, lw);
    }
    for (i64 j = 0; j < n; j++) residual[j] = hidden[j] + residual[j];
    rms_norm_f32(residual, M->normf_w, normed, B, d, M->eps);
    exact_product(&M->head, normed, B, logits, qx, sx, M->threaded_work, M->threads);
}
