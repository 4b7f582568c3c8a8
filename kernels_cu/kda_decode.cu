// kda_decode.cu — one fused KDA decode step per (sequence, head): conv-state shift + conv + SiLU,
// l2norm(q, k), gate, beta, one delta-rule step on the fp32 state, gated RMSNorm (spec §3.2–3.8).
//
//   x = raw q|k|v of the token; hist = previous W-1 raw inputs (zeros when context_lens == 0)
//   q, k, v = bf16(SiLU(conv(hist, x)));  q <- q / sqrt(|q|^2 + 1e-6) * K^-1/2;  k <- k / sqrt(|k|^2 + 1e-6)
//   g = -exp(A_log) softplus(f + dt_bias);  beta = sigmoid(b)
//   S <- diag(exp(g)) S;  r = S^T k;  S <- S + beta k (v - r)^T;  o = S^T q
//      computed as o = (S_decayed^T q) + (q.k) beta (v - r), so S is swept once
//   y = bf16(o) / sqrt(mean(bf16(o)^2) + eps) * o_norm_w * sigmoid(gate)  -> bf16
//
// Rounding points: conv outputs bf16 (as fla); l2norm, gate, state and norm math fp32; o bf16
// before the norm; y bf16.
//
// Grid: (H, B), one CTA per (head, sequence); token b belongs to sequence b (T == B).
// Block: 256 threads = 8 warps.  Threads 0..K-1 do the per-channel prologue for channel tid; for the
// state, warp w owns key rows [16w, 16w+16) and lane l value columns [4l, 4l+4), so every row is
// read and written once as 32 coalesced 16-byte vectors.  The state loads are issued before the
// prologue, so its dependent loads and reductions overlap them instead of preceding them.
// Shapes: qkv [B, 3P] bf16; f, gate [B, P] bf16; b [B, ldb] bf16 (column h); conv_w [3P, W] fp32;
// A_log [H], dt_bias [P], o_norm_w [K] fp32; conv_pool [S, 3, W-1, P] bf16 (oldest first);
// rec_pool [S, H, K, V] fp32; context_lens, state_slots [B] int32; out [B, P] bf16.
// Compile-time constants (chosen in kda_rt/cuda/ops/kda_decode.py): HEAD_DIM (K = V, must be 128),
// CONV_W (W), THREADS.
#include "kda_common.cuh"

#if !defined(HEAD_DIM) || !defined(CONV_W) || !defined(THREADS)
#error "kda_decode.cu needs -DHEAD_DIM -DCONV_W -DTHREADS"
#endif
#if HEAD_DIM != 128
#error "kda_decode.cu: the thread map assumes HEAD_DIM == 128"
#endif
#define K HEAD_DIM
#define NUM_WARPS (THREADS / 32)
#define ROWS_PER_WARP (K / NUM_WARPS)
static_assert(THREADS % 32 == 0 && THREADS >= K && K % NUM_WARPS == 0,
              "kda_decode.cu: whole warps, one thread per channel in the prologue, whole state rows per warp");

// ---------------------------------------------------------------------------------------------
// kernel

extern "C" __global__ void __launch_bounds__(THREADS) kda_decode_step(
    const bf16* __restrict__ qkv, const bf16* __restrict__ f, const bf16* __restrict__ b, int ldb,
    const bf16* __restrict__ gate, const float* __restrict__ conv_w, const float* __restrict__ A_log,
    const float* __restrict__ dt_bias, const float* __restrict__ o_norm_w, bf16* __restrict__ conv_pool,
    float* __restrict__ rec_pool, const int* __restrict__ context_lens, const int* __restrict__ state_slots,
    bf16* __restrict__ out, int num_heads, float eps) {
    __shared__ float q_s[K], k_s[K], v_s[K], decay_s[K];
    __shared__ __align__(16) float red_r[NUM_WARPS][K], red_o[NUM_WARPS][K];
    __shared__ float red3[NUM_WARPS][3];
    const int h = blockIdx.x, seq = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int P = num_heads * K;
    const bool fresh = context_lens[seq] == 0;
    const size_t slot = (size_t)state_slots[seq];

    // ---- the state rows first: their 64 KB per CTA are in flight while the prologue runs
    float4* state = reinterpret_cast<float4*>(rec_pool + (slot * num_heads + h) * K * K) + lane;
    const int row0 = warp * ROWS_PER_WARP;
    float4 s[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) s[i] = fresh ? make_float4(0.f, 0.f, 0.f, 0.f) : state[(row0 + i) * (K / 4)];

    // ---- prologue: conv step (and conv-state shift), gate, l2norm statistics
    float y[3] = {0.f, 0.f, 0.f};
    if (tid < K) {
        const int ch = h * K + tid;
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            bf16* hist_p = conv_pool + (slot * 3 + i) * (CONV_W - 1) * P + ch;
            float hist[CONV_W - 1];
#pragma unroll
            for (int j = 0; j < CONV_W - 1; ++j) hist[j] = fresh ? 0.f : to_f32(hist_p[(size_t)j * P]);
            const bf16 x = qkv[(size_t)seq * 3 * P + i * P + ch];
            y[i] = kda_conv_silu<CONV_W>(conv_w + (size_t)(i * P + ch) * CONV_W, hist, to_f32(x));
#pragma unroll
            for (int j = 0; j < CONV_W - 2; ++j) hist_p[(size_t)j * P] = to_bf16(hist[j + 1]);
            hist_p[(size_t)(CONV_W - 2) * P] = x;
        }
        decay_s[tid] = expf(kda_log_decay(to_f32(f[(size_t)seq * P + ch]), dt_bias[ch], A_log[h]));
        v_s[tid] = y[2];
    }
    float sums[3] = {y[0] * y[0], y[1] * y[1], y[0] * y[1]};  // -> |q|^2, |k|^2, q.k
    block_sum(sums, red3);
    const float qq = sums[0], kk = sums[1];
    float qk = sums[2];
    const float inv_q = rsqrtf((float)K) / sqrtf(qq + 1e-6f), inv_k = 1.f / sqrtf(kk + 1e-6f);
    qk *= inv_q * inv_k;  // q_hat . k_hat
    if (tid < K) q_s[tid] = y[0] * inv_q, k_s[tid] = y[1] * inv_k;
    const float beta = sigmoid(to_f32(b[(size_t)seq * ldb + h]));
    __syncthreads();

    // ---- state sweep: decay, partial S^T k and S^T q over this warp's rows
    float4 pr = make_float4(0.f, 0.f, 0.f, 0.f), po = pr;
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        const float dk = decay_s[row0 + i], kd = k_s[row0 + i], qd = q_s[row0 + i];
        s[i].x *= dk, s[i].y *= dk, s[i].z *= dk, s[i].w *= dk;
        pr.x = fmaf(kd, s[i].x, pr.x), pr.y = fmaf(kd, s[i].y, pr.y), pr.z = fmaf(kd, s[i].z, pr.z), pr.w = fmaf(kd, s[i].w, pr.w);
        po.x = fmaf(qd, s[i].x, po.x), po.y = fmaf(qd, s[i].y, po.y), po.z = fmaf(qd, s[i].z, po.z), po.w = fmaf(qd, s[i].w, po.w);
    }
    reinterpret_cast<float4*>(red_r[warp])[lane] = pr;
    reinterpret_cast<float4*>(red_o[warp])[lane] = po;
    __syncthreads();
    float r[4] = {0.f, 0.f, 0.f, 0.f}, o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) {
        const float4 a = reinterpret_cast<const float4*>(red_r[w])[lane], c = reinterpret_cast<const float4*>(red_o[w])[lane];
        r[0] += a.x, r[1] += a.y, r[2] += a.z, r[3] += a.w;
        o[0] += c.x, o[1] += c.y, o[2] += c.z, o[3] += c.w;
    }
    float delta[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) delta[j] = beta * (v_s[4 * lane + j] - r[j]);

    // ---- delta write, one store per row
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        const float kd = k_s[row0 + i];
        s[i].x = fmaf(kd, delta[0], s[i].x), s[i].y = fmaf(kd, delta[1], s[i].y);
        s[i].z = fmaf(kd, delta[2], s[i].z), s[i].w = fmaf(kd, delta[3], s[i].w);
        state[(row0 + i) * (K / 4)] = s[i];
    }

    // ---- read-out and gated RMSNorm: warp 0 holds all K outputs (4 per lane)
    if (warp == 0) {
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[j] = round_bf16(fmaf(qk, delta[j], o[j]));
            ss = fmaf(o[j], o[j], ss);
        }
        const float inv = rsqrtf(warp_sum(ss) / (float)K + eps);
        const size_t base = (size_t)seq * P + h * K + 4 * lane;
        __align__(8) bf16 res[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            res[j] = to_bf16(o[j] * inv * o_norm_w[4 * lane + j] * sigmoid(to_f32(gate[base + j])));
        *reinterpret_cast<uint2*>(out + base) = *reinterpret_cast<const uint2*>(res);
    }
}
