// fabric-moe's kernels, part 3 of 4: the combine stages.

// 8 bf16 of `v` times `w`, added into acc.
__device__ __forceinline__ void fma8(float* acc, V16 v, float w) {
    u32 words[4] = {v.a, v.b, v.c, v.d};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        acc[2 * q] += w * bf16_to_f32(words[q]);
        acc[2 * q + 1] += w * bf16_to_f32(words[q] >> 16);
    }
}

__device__ __forceinline__ V16 pack8(const float* acc) {
    V16 o;
    o.a = f32_to_bf16(acc[0]) | (f32_to_bf16(acc[1]) << 16);
    o.b = f32_to_bf16(acc[2]) | (f32_to_bf16(acc[3]) << 16);
    o.c = f32_to_bf16(acc[4]) | (f32_to_bf16(acc[5]) << 16);
    o.d = f32_to_bf16(acc[6]) | (f32_to_bf16(acc[7]) << 16);
    return o;
}

// The send stage (moe_combine_send, and the first half of moe_combine). `local` (rank-major
// only, else 0): this rank's own rows are not copied into its window; the receive stage reads
// them from expert_out (moe_combine passes it to both halves).
__device__ void combine_send_body(const char* expert_out, const char* window, const int* recv_pos,
                                  const int* recv_count, const u64* peers, u64* state, u32 rank, u32 ranks,
                                  u32 max_tokens, u32 k, u32 experts_per_rank, u32 capacity, u32 hidden,
                                  u64 off_cflag, u64 off_meta, u64 off_cx, u32 rank_major, const u64* proxy,
                                  u64* status, u32 local) {
    if (blockIdx.x == 0) PROBE(status, 10);
    u32 lane = threadIdx.x & 31;
    u32 warps = gridDim.x * (blockDim.x >> 5);
    u32 meta_words = 1 + 3 * k;
    u64 row_bytes = (u64)hidden * 2;
    int first = (int)(rank * experts_per_rank);
    bool vec = (hidden % 8 == 0) && (((u64)expert_out & 15ull) == 0);
    // Work items: (row, segment), so that few rows still use many warps (row_seg_len).
    u32 chunks = hidden / 8;
    u32 rows = 0;
    for (u32 q = 0; q < ranks; ++q) rows += (u32)recv_count[q];
    u32 seg_len = vec ? row_seg_len(chunks, warps, rows) : chunks;
    u32 segs = vec ? (chunks + seg_len - 1) / seg_len : 1;
    u64 items = (u64)ranks * max_tokens * segs;
    for (u64 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
        u32 i = (u32)(it / segs), seg = (u32)(it % segs);
        u32 s = i / max_tokens, slot = i % max_tokens;
        if ((int)slot >= recv_count[s] || (local && s == rank)) continue;
        const int* meta = (const int*)(window + off_meta) + (u64)i * meta_words;
        u32 sec;
        // (Two statements: px_base sets `sec`, which the offset then reads.)
        char* base = px_base(peers, proxy, s, rank, &sec);
        char* dst = base + off_cx + ((u64)sec * max_tokens + slot) * row_bytes;
        if (rank_major) {
            // The caller's row for this received row is already weighted and summed over
            // this rank's experts: it goes back as it is.
            const char* src = expert_out + (u64)i * row_bytes;
            if (vec) {
                copy_seg((V16*)dst, (const V16*)src, seg * seg_len, min(chunks, (seg + 1) * seg_len), lane);
            } else {
                copy_row(dst, src, (u32)row_bytes, lane);
            }
        } else if (vec && k <= FAST_K) {
            // The row's expert outputs and weights first, in registers: the loads of one chunk
            // are then independent of each other.
            const V16* rows[FAST_K];
            float ws[FAST_K];
#pragma unroll
            for (int j = 0; j < FAST_K; ++j) {
                rows[j] = (const V16*)0;
                ws[j] = 0.f;
                if ((u32)j < k) {
                    int pos = recv_pos[(u64)i * k + j];
                    if (pos >= 0) {
                        int le = meta[1 + j] - first;
                        rows[j] = (const V16*)(expert_out + ((u64)le * capacity + pos) * row_bytes);
                        ws[j] = __int_as_float(meta[1 + k + j]);
                    }
                }
            }
            u32 end = min(chunks, (seg + 1) * seg_len);
            u32 c = seg * seg_len + lane;
            // Two chunks a round: every expert row's two loads in flight before the stores
            // (which may alias them as far as the compiler knows).
            for (; c + 32 < end; c += 64) {
                V16 v[FAST_K], w[FAST_K];
#pragma unroll
                for (int j = 0; j < FAST_K; ++j) {
                    if (rows[j]) {
                        v[j] = rows[j][c];
                        w[j] = rows[j][c + 32];
                    }
                }
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                float acc2[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < FAST_K; ++j) {
                    if (rows[j]) {
                        fma8(acc, v[j], ws[j]);
                        fma8(acc2, w[j], ws[j]);
                    }
                }
                ((V16*)dst)[c] = pack8(acc);
                ((V16*)dst)[c + 32] = pack8(acc2);
            }
            for (; c < end; c += 32) {
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int j = 0; j < FAST_K; ++j) {
                    if (rows[j]) fma8(acc, rows[j][c], ws[j]);
                }
                ((V16*)dst)[c] = pack8(acc);
            }
        } else if (vec) {
            u32 end = min(chunks, (seg + 1) * seg_len);
            for (u32 c = seg * seg_len + lane; c < end; c += 32) {
                float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                for (u32 j = 0; j < k; ++j) {
                    int pos = recv_pos[(u64)i * k + j];
                    if (pos < 0) continue;
                    int le = meta[1 + j] - first;
                    float w = __int_as_float(meta[1 + k + j]);
                    const V16* row = (const V16*)(expert_out + ((u64)le * capacity + pos) * row_bytes);
                    fma8(acc, row[c], w);
                }
                ((V16*)dst)[c] = pack8(acc);
            }
        } else {
            for (u32 h = lane; h < hidden; h += 32) {
                float acc = 0.f;
                for (u32 j = 0; j < k; ++j) {
                    int pos = recv_pos[(u64)i * k + j];
                    if (pos < 0) continue;
                    int le = meta[1 + j] - first;
                    float w = __int_as_float(meta[1 + k + j]);
                    const u16* row = (const u16*)(expert_out + ((u64)le * capacity + pos) * row_bytes);
                    acc += w * bf16_to_f32(row[h]);
                }
                ((u16*)dst)[h] = (u16)f32_to_bf16(acc);
            }
        }
    }
    if (blockIdx.x == 0) PROBE(status, 11);
    if (!last_block(&state[ST_DONE_CSEND], true)) return;
    PROBE(status, 12);
    u64 seq = (state[ST_CSEND] + 1) & 0xffffffffull;
    if (threadIdx.x < ranks) {
        u32 d = threadIdx.x;
        px_raise(peers, proxy, d, rank, off_cflag, PX_COMBINE, (seq << 32) | (u32)recv_count[d]);
    }
    __syncthreads();
    PROBE(status, 13);
    if (threadIdx.x == 0) {
        state[ST_CSEND] = seq;
        state[ST_DONE_CSEND] = 0;
    }
}

// Rank d's partial row of this rank's token in `slot` of d's rows: in the window's cx section
// d, or for d == rank with local_out, in the caller's expert_out (rank-major rows).
__device__ __forceinline__ const char* partial(const char* window, u64 off_cx, const char* local_out, u32 rank,
                                               u32 d, u32 max_tokens, int slot, u64 row_bytes) {
    u64 row = (u64)d * max_tokens + (u32)slot;
    if (local_out && d == rank) return local_out + row * row_bytes;
    return window + off_cx + row * row_bytes;
}

// The receive stage (moe_combine_recv, and the second half of moe_combine). `local_out`
// (0: none): where this rank's own partial rows are, rank-major (row rank * max_tokens +
// slot of the caller's expert_out) instead of this rank's section of the window.
__device__ void combine_recv_body(char* out, const char* window, const int* send_slot, u64* state, u64* status,
                                  u32 rank, u32 ranks, u32 max_tokens, u32 hidden, u64 off_cflag, u64 off_cx,
                                  u64 timeout_ns, const u64* proxy, const char* local_out) {
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    if (blockIdx.x == 0) PROBE(status, 14);
    __syncthreads();
    if (threadIdx.x < ranks) {
        u32 want = (u32)(state[ST_CRECV] + 1);
        if (px_wait(proxy, PX_COMBINE, threadIdx.x, want, PX_WRITES_COMBINE, timeout_ns, &failed)) {
            wait_seq((const u64*)(window + off_cflag) + threadIdx.x, want, timeout_ns, &failed);
        }
    }
    __syncthreads();
    if (blockIdx.x == 0) PROBE(status, 15);
    __threadfence();
    if (failed) {
        if (threadIdx.x == 0) report(status, ERR_COMBINE_TIMEOUT, blockIdx.x);
    } else {
        u32 lane = threadIdx.x & 31;
        u32 warps = gridDim.x * (blockDim.x >> 5);
        u32 num_tokens = (u32)state[ST_TOKENS];
        u64 row_bytes = (u64)hidden * 2;
        bool vec = (hidden % 8 == 0) && (((u64)out & 15ull) == 0);
        u32 chunks = hidden / 8;
        u32 seg_len = vec ? row_seg_len(chunks, warps, num_tokens) : chunks;
        u32 segs = vec ? (chunks + seg_len - 1) / seg_len : 1;
        u64 items = (u64)num_tokens * segs;
        for (u64 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
            u32 t = (u32)(it / segs), seg = (u32)(it % segs);
            char* dst = out + (u64)t * row_bytes;
            const int* slots = send_slot + (u64)t * ranks;
            if (vec && ranks <= FAST_R) {
                const V16* rows[FAST_R];
#pragma unroll
                for (int d = 0; d < FAST_R; ++d) {
                    int slot = (u32)d < ranks ? slots[d] : -1;
                    rows[d] = slot < 0 ? (const V16*)0 : (const V16*)partial(window, off_cx, local_out, rank, d, max_tokens, slot, row_bytes);
                }
                u32 end = min(chunks, (seg + 1) * seg_len);
                u32 c = seg * seg_len + lane;
                // Two chunks a round, every row's loads before the stores (as in the send).
                for (; c + 32 < end; c += 64) {
                    V16 v[FAST_R], w[FAST_R];
#pragma unroll
                    for (int d = 0; d < FAST_R; ++d) {
                        if (rows[d]) {
                            v[d] = rows[d][c];
                            w[d] = rows[d][c + 32];
                        }
                    }
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                    float acc2[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int d = 0; d < FAST_R; ++d) {
                        if (rows[d]) {
                            fma8(acc, v[d], 1.0f);
                            fma8(acc2, w[d], 1.0f);
                        }
                    }
                    ((V16*)dst)[c] = pack8(acc);
                    ((V16*)dst)[c + 32] = pack8(acc2);
                }
                for (; c < end; c += 32) {
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
                    for (int d = 0; d < FAST_R; ++d) {
                        if (rows[d]) fma8(acc, rows[d][c], 1.0f);
                    }
                    ((V16*)dst)[c] = pack8(acc);
                }
            } else if (vec) {
                u32 end = min(chunks, (seg + 1) * seg_len);
                for (u32 c = seg * seg_len + lane; c < end; c += 32) {
                    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
                    for (u32 d = 0; d < ranks; ++d) {
                        int slot = slots[d];
                        if (slot < 0) continue;
                        const V16* row = (const V16*)partial(window, off_cx, local_out, rank, d, max_tokens, slot, row_bytes);
                        fma8(acc, row[c], 1.0f);
                    }
                    ((V16*)dst)[c] = pack8(acc);
                }
            } else {
                for (u32 h = lane; h < hidden; h += 32) {
                    float acc = 0.f;
                    for (u32 d = 0; d < ranks; ++d) {
                        int slot = slots[d];
                        if (slot < 0) continue;
                        const u16* row = (const u16*)partial(window, off_cx, local_out, rank, d, max_tokens, slot, row_bytes);
                        acc += bf16_to_f32(row[h]);
                    }
                    ((u16*)dst)[h] = (u16)f32_to_bf16(acc);
                }
            }
        }
    }
    if (blockIdx.x == 0) PROBE(status, 16);
    if (!last_block(&state[ST_DONE_CRECV], false)) return;
    PROBE(status, 17);
    if (threadIdx.x == 0) {
        state[ST_CRECV] = (state[ST_CRECV] + 1) & 0xffffffffull;
        state[ST_DONE_CRECV] = 0;
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_combine_send(const char* expert_out, const char* window, const int* recv_pos,
                                            const int* recv_count, const u64* peers, u64* state, u32 rank,
                                            u32 ranks, u32 max_tokens, u32 k, u32 experts_per_rank,
                                            u32 capacity, u32 hidden, u64 off_cflag, u64 off_meta,
                                            u64 off_cx, u32 rank_major, const u64* proxy, u64* status) {
    combine_send_body(expert_out, window, recv_pos, recv_count, peers, state, rank, ranks, max_tokens, k,
                      experts_per_rank, capacity, hidden, off_cflag, off_meta, off_cx, rank_major, proxy, status,
                      0);
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_combine_recv(char* out, const char* window, const int* send_slot, u64* state,
                                            u64* status, u32 rank, u32 ranks, u32 max_tokens, u32 hidden,
                                            u64 off_cflag, u64 off_cx, u64 timeout_ns, const u64* proxy) {
    combine_recv_body(out, window, send_slot, state, status, rank, ranks, max_tokens, hidden, off_cflag, off_cx,
                      timeout_ns, proxy, (const char*)0);
}

// Both stages in one launch (AllToAll::combine without proxy ranks), as moe_dispatch: every
// block resident at once. Rank-major, this rank's own rows stay in expert_out (no copy
// through the window).
extern "C" __global__ void __launch_bounds__(256, 2) moe_combine(const char* expert_out, const char* window, const int* recv_pos,
                                       const int* recv_count, const u64* peers, u64* state, u32 rank, u32 ranks,
                                       u32 max_tokens, u32 k, u32 experts_per_rank, u32 capacity, u32 hidden,
                                       u64 off_cflag, u64 off_meta, u64 off_cx, u32 rank_major, const u64* proxy,
                                       u64* status, char* out, const int* send_slot, u64 timeout_ns) {
    // (The receive's 16 B loads of expert_out need it aligned, as the send's.)
    u32 local = rank_major && ((u64)expert_out & 15ull) == 0;
    combine_send_body(expert_out, window, recv_pos, recv_count, peers, state, rank, ranks, max_tokens, k,
                      experts_per_rank, capacity, hidden, off_cflag, off_meta, off_cx, rank_major, proxy, status,
                      local);
    combine_recv_body(out, window, send_slot, state, status, rank, ranks, max_tokens, hidden, off_cflag, off_cx,
                      timeout_ns, proxy, local ? expert_out : (const char*)0);
}
