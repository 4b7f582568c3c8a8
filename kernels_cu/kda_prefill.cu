// kda_prefill.cu — KDA prefill over a varlen flat batch: per-token prologue, then the chunked
// (WY / UT) delta rule with the fp32 state in shared memory (spec §3.2–3.8).
//
// kda_prefill_prep, grid (T, H), block K: for token t of sequence b (found by binary search in
// cu_seqlens) and head h, channel c = threadIdx.x:
//   q, k, v = bf16(SiLU(conv)) over the sequence's own tokens and, before its start, the slot's
//   conv state (zeros when context_lens[b] == 0);  q <- l2norm(q) K^-1/2,  k <- l2norm(k)
//   g2 = log2(e) * (-exp(A_log) softplus(f + dt_bias))   (log2 domain: every decay is one exp2f)
//   beta = sigmoid(b)                     -> workspace qn, kn, vn, gn [H, T, K], beta [H, T] fp32
//
// kda_prefill_chunk, grid (H, B), block THREADS = 256, ~219 KB dynamic shared memory: one CTA walks
// the chunks (L = CHUNK = 64 tokens, tail padded with q = k = v = g = beta = 0) of one (sequence, head):
//   A_qk[r,s] = sum_d q_r k_s E[r,s] (s <= r),  A_kk[r,s] = beta_r sum_d k_r k_s E[r,s] (s < r),
//   E[r,s] = exp(G_r - G_s) with G the inclusive in-chunk prefix sum of g
//   W = (I + A_kk)^-1 (beta e^G k),  U = (I + A_kk)^-1 (beta v)     (forward substitution)
//   V_new = U - W S;  O = (q e^G) S + A_qk V_new;  S <- diag(e^G_last) S + (e^(G_last - G) k)^T V_new
//   y = bf16(O) / sqrt(mean(bf16(O)^2) + eps) * o_norm_w * sigmoid(gate)  -> out bf16
// and, first, writes the sequence's last W-1 raw inputs to its conv-state slot.
//
// Safe gates (g can be -300 and below): G is never formed as one long prefix sum that is later
// differenced.  Inside each 16-row sub-block n..n+15 the kernel keeps Lam_r = sum_{n<i<=r} g_i, and
// per sub-block first gate, total, and sums of whole sub-blocks; every exponent is then
// (Lam_r - Lam_s) + (sum of gates of whole blocks / block edges), so cancellation is limited to
// 15 gates and every exponent used is <= 0 (clamped), never exp(-G) alone.
//
// Rounding points: conv outputs bf16; q, k, l2norm, gates, A, W, U, V_new, state fp32; O bf16
// before the norm; y bf16.
// Shapes: qkv [T, 3P], f, gate [T, P], b [T, ldb] bf16; conv_w [3P, W], A_log [H], dt_bias [P],
// o_norm_w [K] fp32; conv_pool [S, 3, W-1, P] bf16; rec_pool [S, H, K, V] fp32; cu_seqlens [B+1],
// context_lens, state_slots [B] int32; out [T, P] bf16.
// Compile-time constants (chosen in kda_rt/cuda/ops/kda_prefill.py): HEAD_DIM (K = V, must be
// 128), CONV_W (W), CHUNK (L), SUB (rows per sub-block), LD (padded row stride of the chunk tiles,
// floats), THREADS (block of kda_prefill_chunk).
#include "kda_common.cuh"

#if !defined(HEAD_DIM) || !defined(CONV_W) || !defined(CHUNK) || !defined(SUB) || !defined(LD) || !defined(THREADS)
#error "kda_prefill.cu needs -DHEAD_DIM -DCONV_W -DCHUNK -DSUB -DLD -DTHREADS"
#endif
#if HEAD_DIM != 128
#error "kda_prefill.cu: the thread maps assume HEAD_DIM == 128"
#endif
#define K HEAD_DIM
#define NUM_SUB (CHUNK / SUB)
#define NUM_CROSS (NUM_SUB * (NUM_SUB - 1) / 2)  // (row block, earlier column block) pairs
#define LOG2E 1.4426950408889634f

// kda_prefill_chunk's threads (ty, tx) form a 16 x 16 grid: SUB rows of a sub-block in (b), 4 chunk
// rows x 8 key / value columns each in (c), (f), (g), one column of W or U each in (e)
static_assert(THREADS == SUB * SUB && THREADS == 2 * K && CHUNK == 4 * SUB && K == 8 * SUB,
              "kda_prefill.cu: the thread maps need THREADS = 256, SUB = 16, CHUNK = 64");
static_assert(LD >= K && LD % 4 == 0, "kda_prefill.cu: LD must hold a row and keep float4 alignment");

// ---------------------------------------------------------------------------------------------
// helpers

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ void st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void unpack4(float4 v, float (&a)[4]) { a[0] = v.x, a[1] = v.y, a[2] = v.z, a[3] = v.w; }

// 8 consecutive floats (16-byte aligned) as two float4 loads
__device__ __forceinline__ void load8(const float* p, float (&a)[8]) {
    unpack4(ld4(p), *reinterpret_cast<float(*)[4]>(a));
    unpack4(ld4(p + 4), *reinterpret_cast<float(*)[4]>(a + 4));
}

// index of the (row block I, column block J < I) pair in the cross-block exponent table
__device__ __forceinline__ constexpr int cross_index(int I, int J) { return I * (I - 1) / 2 + J; }

// This thread's 4 x 8 tile of A S: acc[i][j] += (or -=, Negate) sum_d A[4ty+i][d] S[d][8tx+j],
// A a chunk tile (row stride LD), S the K x K state.
template <bool Negate>
__device__ __forceinline__ void tile_times_state(float (&acc)[4][8], const float* A, const float* S, int ty, int tx) {
    for (int d = 0; d < K; d += 4) {
        float a[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) unpack4(ld4(A + (4 * ty + i) * LD + d), a[i]);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float sv[8];
            load8(S + (d + e) * K + 8 * tx, sv);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(Negate ? -a[i][e] : a[i][e], sv[j], acc[i][j]);
        }
    }
}

// dynamic shared memory plan of kda_prefill_chunk, in floats (kda_prefill.py sizes it the same way)
#define SM_S 0                              // state [K][K]
#define SM_Q (SM_S + K * K)                 // q, then q e^G, then W  [CHUNK][LD]
#define SM_K (SM_Q + CHUNK * LD)            // k, then e^(G_last - G) k
#define SM_V (SM_K + CHUNK * LD)            // v, then beta v -> U -> V_new
#define SM_G (SM_V + CHUNK * LD)            // g2, then Lam
#define SM_M (SM_G + CHUNK * LD)            // [CHUNK][CHUNK]: A_qk on/below the diagonal, beta*A_kk transposed above
#define SM_C (SM_M + CHUNK * CHUNK)         // [NUM_CROSS][K] cross-block exponent offsets
#define SM_P (SM_C + NUM_CROSS * K)         // [NUM_SUB][K] G at each sub-block's first row
#define SM_R (SM_P + NUM_SUB * K)           // [NUM_SUB][K] sum of the gates of the later sub-blocks
#define SM_B (SM_R + NUM_SUB * K)           // [CHUNK] beta
#define SM_FLOATS (SM_B + CHUNK)

// ---------------------------------------------------------------------------------------------
// kernels

extern "C" __global__ void __launch_bounds__(K) kda_prefill_prep(
    const bf16* __restrict__ qkv, const bf16* __restrict__ f, const bf16* __restrict__ b, int ldb,
    const float* __restrict__ conv_w, const float* __restrict__ A_log, const float* __restrict__ dt_bias,
    const bf16* __restrict__ conv_pool, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens,
    const int* __restrict__ state_slots, float* __restrict__ qn, float* __restrict__ kn, float* __restrict__ vn,
    float* __restrict__ gn, float* __restrict__ beta_n, int num_tokens, int num_seqs, int num_heads) {
    __shared__ float red[K / 32][2];
    const int tok = blockIdx.x, h = blockIdx.y, c = threadIdx.x;
    const int P = num_heads * K, ch = h * K + c;
    const int lo = sequence_of(cu_seqlens, num_seqs, tok);  // cu_seqlens[lo] <= tok < cu_seqlens[lo + 1]
    const int start = cu_seqlens[lo], pos = tok - start;
    const bool fresh = context_lens[lo] == 0;
    const size_t slot = (size_t)state_slots[lo];
    float y[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) {
        float hist[CONV_W - 1];
#pragma unroll
        for (int j = 0; j < CONV_W - 1; ++j) {
            const int p = pos - (CONV_W - 1) + j;  // position in the sequence; < 0 reads the slot's history
            hist[j] = p >= 0 ? to_f32(qkv[(size_t)(start + p) * 3 * P + i * P + ch])
                    : fresh  ? 0.f
                             : to_f32(conv_pool[((slot * 3 + i) * (CONV_W - 1) + (CONV_W - 1 + p)) * P + ch]);
        }
        y[i] = kda_conv_silu<CONV_W>(conv_w + (size_t)(i * P + ch) * CONV_W, hist, to_f32(qkv[(size_t)tok * 3 * P + i * P + ch]));
    }
    float sq[2] = {y[0] * y[0], y[1] * y[1]};  // -> |q|^2, |k|^2
    block_sum(sq, red);
    const size_t o = ((size_t)h * num_tokens + tok) * K + c;
    qn[o] = y[0] * (rsqrtf((float)K) / sqrtf(sq[0] + 1e-6f));
    kn[o] = y[1] / sqrtf(sq[1] + 1e-6f);
    vn[o] = y[2];
    gn[o] = LOG2E * kda_log_decay(to_f32(f[(size_t)tok * P + ch]), dt_bias[ch], A_log[h]);
    if (c == 0) beta_n[(size_t)h * num_tokens + tok] = sigmoid(to_f32(b[(size_t)tok * ldb + h]));
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) kda_prefill_chunk(
    const float* __restrict__ qn, const float* __restrict__ kn, const float* __restrict__ vn,
    const float* __restrict__ gn, const float* __restrict__ beta_n, const bf16* __restrict__ qkv,
    const bf16* __restrict__ gate, const float* __restrict__ o_norm_w, bf16* __restrict__ conv_pool,
    float* __restrict__ rec_pool, const int* __restrict__ cu_seqlens, const int* __restrict__ context_lens,
    const int* __restrict__ state_slots, bf16* __restrict__ out, int num_tokens, int num_heads, float eps) {
    extern __shared__ float4 smem4[];
    float* sm = reinterpret_cast<float*>(smem4);
    float *S = sm + SM_S, *Qc = sm + SM_Q, *Kc = sm + SM_K, *Vc = sm + SM_V, *Gc = sm + SM_G, *M = sm + SM_M;
    float *Cc = sm + SM_C, *Pc = sm + SM_P, *Rc = sm + SM_R, *Bc = sm + SM_B;
    const int h = blockIdx.x, seq = blockIdx.y, tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int P = num_heads * K;
    const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
    const bool fresh = context_lens[seq] == 0;
    const size_t slot = (size_t)state_slots[seq];

    // ---- conv state <- the last W-1 raw inputs (old history for sequences shorter than W-1).
    // Entry j reads old entry len + j > j, so ascending j never reads what it already replaced.
    for (int idx = tid; idx < 3 * K; idx += THREADS) {
        const int i = idx / K, ch = h * K + idx % K;
        bf16* hist = conv_pool + (slot * 3 + i) * (CONV_W - 1) * P + ch;
#pragma unroll
        for (int j = 0; j < CONV_W - 1; ++j) {
            const int p = len - (CONV_W - 1) + j;
            hist[(size_t)j * P] = p >= 0 ? qkv[(size_t)(start + p) * 3 * P + i * P + ch]
                                : fresh  ? to_bf16(0.f)
                                         : hist[(size_t)(len + j) * P];
        }
    }

    // ---- initial state
    float* state = rec_pool + (slot * num_heads + h) * K * K;
    for (int idx = tid; idx < K * K / 4; idx += THREADS)
        st4(S + 4 * idx, fresh ? make_float4(0.f, 0.f, 0.f, 0.f) : ld4(state + 4 * idx));

    for (int c0 = 0; c0 < len; c0 += CHUNK) {
        const int n = min(CHUNK, len - c0);
        const size_t row0 = (size_t)h * num_tokens + start + c0;  // workspace row of the chunk's first token

        // ---- (a) load the chunk, zero-padded
        for (int idx = tid; idx < CHUNK * K / 4; idx += THREADS) {
            const int r = idx / (K / 4), c4 = 4 * (idx % (K / 4));
            const bool ok = r < n;
            const size_t src = (row0 + r) * K + c4;
            const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
            st4(Qc + r * LD + c4, ok ? ld4(qn + src) : z);
            st4(Kc + r * LD + c4, ok ? ld4(kn + src) : z);
            st4(Vc + r * LD + c4, ok ? ld4(vn + src) : z);
            st4(Gc + r * LD + c4, ok ? ld4(gn + src) : z);
        }
        if (tid < CHUNK) Bc[tid] = tid < n ? beta_n[row0 + tid] : 0.f;
        __syncthreads();

        // ---- (a2) gate bookkeeping per key channel d: Lam inside sub-blocks, block sums, offsets
        if (tid < K) {
            const int d = tid;
            float first[NUM_SUB], total[NUM_SUB], last[NUM_SUB];
#pragma unroll
            for (int I = 0; I < NUM_SUB; ++I) {
                float* g = Gc + I * SUB * LD + d;
                first[I] = g[0];
                g[0] = 0.f;
                float acc = 0.f;
#pragma unroll
                for (int r = 1; r < SUB; ++r) acc += g[r * LD], g[r * LD] = acc;
                last[I] = acc;
                total[I] = first[I] + acc;
            }
            float run = 0.f;
#pragma unroll
            for (int I = 0; I < NUM_SUB; ++I) Pc[I * K + d] = run + first[I], run += total[I];
            run = 0.f;
#pragma unroll
            for (int J = NUM_SUB - 1; J >= 0; --J) Rc[J * K + d] = run, run += total[J];
#pragma unroll
            for (int I = 1; I < NUM_SUB; ++I) {
#pragma unroll
                for (int J = 0; J < I; ++J) {
                    float acc = last[J];
#pragma unroll
                    for (int B = J + 1; B < I; ++B) acc += total[B];
                    Cc[cross_index(I, J) * K + d] = acc + first[I];
                }
            }
        }
        __syncthreads();

        // ---- (b) A_qk and beta*A_kk.  Thread (ty, tx) owns rows r = ty + 16i, columns s = tx + 16j:
        // pairs i > j are below the diagonal, i == j only when tx <= ty.
        {
            float aqk[NUM_SUB][NUM_SUB], akk[NUM_SUB][NUM_SUB];
#pragma unroll
            for (int i = 0; i < NUM_SUB; ++i)
#pragma unroll
                for (int j = 0; j < NUM_SUB; ++j) aqk[i][j] = 0.f, akk[i][j] = 0.f;
            const bool diag = tx <= ty;
            for (int d = 0; d < K; d += 4) {
                float qr[NUM_SUB][4], kr[NUM_SUB][4], lr[NUM_SUB][4], ks[NUM_SUB][4], ls[NUM_SUB][4];
#pragma unroll
                for (int i = 0; i < NUM_SUB; ++i) {
                    const int r = (ty + SUB * i) * LD + d, s = (tx + SUB * i) * LD + d;
                    unpack4(ld4(Qc + r), qr[i]), unpack4(ld4(Kc + r), kr[i]), unpack4(ld4(Gc + r), lr[i]);
                    unpack4(ld4(Kc + s), ks[i]), unpack4(ld4(Gc + s), ls[i]);
                }
#pragma unroll
                for (int i = 0; i < NUM_SUB; ++i) {
#pragma unroll
                    for (int j = 0; j <= i; ++j) {
                        if (i == j && !diag) continue;
                        float cx[4] = {0.f, 0.f, 0.f, 0.f};
                        if (i != j) unpack4(ld4(Cc + cross_index(i, j) * K + d), cx);
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            const float ex = exp2f(fminf((lr[i][e] - ls[j][e]) + cx[e], 0.f));
                            aqk[i][j] = fmaf(qr[i][e] * ks[j][e], ex, aqk[i][j]);
                            akk[i][j] = fmaf(kr[i][e] * ks[j][e], ex, akk[i][j]);
                        }
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < NUM_SUB; ++i) {
#pragma unroll
                for (int j = 0; j <= i; ++j) {
                    const int r = ty + SUB * i, s = tx + SUB * j;
                    if (s <= r) M[r * CHUNK + s] = aqk[i][j];
                    if (s < r) M[s * CHUNK + r] = Bc[r] * akk[i][j];
                }
            }
        }
        __syncthreads();

        // ---- (c) q <- q e^G, v <- beta v;  then O = (q e^G) S into registers (rows 4ty+i, columns 8tx+j)
        for (int idx = tid; idx < CHUNK * K; idx += THREADS) {
            const int r = idx / K, d = idx % K;
            Qc[r * LD + d] *= exp2f(Gc[r * LD + d] + Pc[(r / SUB) * K + d]);
            Vc[r * LD + d] *= Bc[r];
        }
        __syncthreads();
        float acc_o[4][8];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) acc_o[i][j] = 0.f;
        tile_times_state<false>(acc_o, Qc, S, ty, tx);
        __syncthreads();

        // ---- (d) Q <- beta e^G k  (right-hand side of W)
        for (int idx = tid; idx < CHUNK * K; idx += THREADS) {
            const int r = idx / K, d = idx % K;
            Qc[r * LD + d] = Bc[r] * exp2f(Gc[r * LD + d] + Pc[(r / SUB) * K + d]) * Kc[r * LD + d];
        }
        __syncthreads();

        // ---- (e) forward substitution (I + beta A_kk) X = RHS, one column per thread: W (warps 0-3), U (4-7)
        {
            float* col = (tid < K ? Qc : Vc) + (tid & (K - 1));
            for (int i = 1; i < CHUNK; ++i) {
                float acc = col[i * LD];
                for (int j = 0; j < i; ++j) acc = fmaf(-M[j * CHUNK + i], col[j * LD], acc);
                col[i * LD] = acc;
            }
        }
        __syncthreads();

        // ---- (f) V_new = U - W S (own tile of Vc, read and written by this thread only)
        {
            float acc[4][8];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = Vc[(4 * ty + i) * LD + 8 * tx + j];
            tile_times_state<true>(acc, Qc, S, ty, tx);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) Vc[(4 * ty + i) * LD + 8 * tx + j] = acc[i][j];
        }
        __syncthreads();

        // ---- (g) O += A_qk V_new, gated RMSNorm, store; (h) k <- e^(G_last - G) k for the state update
        for (int s = 0; s < 4 * ty + 4; ++s) {
            float vv[8];
            load8(Vc + s * LD + 8 * tx, vv);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = 4 * ty + i;
                const float a = s <= r ? M[r * CHUNK + s] : 0.f;
#pragma unroll
                for (int j = 0; j < 8; ++j) acc_o[i][j] = fmaf(a, vv[j], acc_o[i][j]);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = 4 * ty + i;
            float ss = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc_o[i][j] = round_bf16(acc_o[i][j]), ss = fmaf(acc_o[i][j], acc_o[i][j], ss);
            ss = warp_sum<16>(ss);  // the 16 tx lanes of row r
            if (r < n) {
                const float inv = rsqrtf(ss / (float)K + eps);
                const size_t base = (size_t)(start + c0 + r) * P + h * K + 8 * tx;
                const bf16x8 gv = *reinterpret_cast<const bf16x8*>(gate + base);
                bf16x8 res;
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    res.v[j] = to_bf16(acc_o[i][j] * inv * o_norm_w[8 * tx + j] * sigmoid(to_f32(gv.v[j])));
                *reinterpret_cast<bf16x8*>(out + base) = res;
            }
        }
        for (int idx = tid; idx < CHUNK * K; idx += THREADS) {
            const int r = idx / K, d = idx % K, J = r / SUB;
            const float tail = (Gc[(J * SUB + SUB - 1) * LD + d] - Gc[r * LD + d]) + Rc[J * K + d];
            Kc[r * LD + d] *= exp2f(fminf(tail, 0.f));
        }
        __syncthreads();

        // ---- (i) S <- diag(e^G_last) S + (e^(G_last - G) k)^T V_new; rows 8ty+i, columns 8tx+j
        {
            float acc[8][8];
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
            for (int s = 0; s < CHUNK; ++s) {
                float kt[8], vv[8];
                load8(Kc + s * LD + 8 * ty, kt);
                load8(Vc + s * LD + 8 * tx, vv);
#pragma unroll
                for (int i = 0; i < 8; ++i)
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(kt[i], vv[j], acc[i][j]);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int d = 8 * ty + i;
                const float decay = exp2f(Pc[(NUM_SUB - 1) * K + d] + Gc[(CHUNK - 1) * LD + d]);
#pragma unroll
                for (int j = 0; j < 8; ++j) S[d * K + 8 * tx + j] = fmaf(decay, S[d * K + 8 * tx + j], acc[i][j]);
            }
        }
        __syncthreads();
    }

    // ---- final state back to the slot
    for (int idx = tid; idx < K * K / 4; idx += THREADS) st4(state + 4 * idx, ld4(S + 4 * idx));
}
