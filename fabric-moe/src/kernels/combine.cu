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

// One warp's chunks c, c + 32, ... below `end` of dst = sum over j < N of ws[j] * rows[j]
// (null rows left out), in f32, as bf16: the sums of both stages (rows[] and ws[] in
// registers, every index known at compile time). Two chunks a round: every row's two loads
// in flight before the stores (which may alias them as far as the compiler knows).
template <int N>
__device__ __forceinline__ void sum_seg(V16* dst, const V16* const* rows, const float* ws, u32 c, u32 end) {
    for (; c + 32 < end; c += 64) {
        V16 v[N], w[N];
#pragma unroll
        for (int j = 0; j < N; ++j) {
            if (rows[j]) {
                v[j] = rows[j][c];
                w[j] = rows[j][c + 32];
            }
        }
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        float acc2[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < N; ++j) {
            if (rows[j]) {
                fma8(acc, v[j], ws[j]);
                fma8(acc2, w[j], ws[j]);
            }
        }
        dst[c] = pack8(acc);
        dst[c + 32] = pack8(acc2);
    }
    for (; c < end; c += 32) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < N; ++j) {
            if (rows[j]) fma8(acc, rows[j][c], ws[j]);
        }
        dst[c] = pack8(acc);
    }
}

// Streamed combine (moe_combine with send_blocks > 0): each row of the send is one warp's,
// and once it is written the warp raises the row's flag in the destination's window,
// crow[source][slot] = seq << 32, so that the blocks that sum (the others) take each
// token as soon as its rows have landed instead of after the last block's flag.
__device__ __forceinline__ void raise_row(u64* flag, u64 seq) {
    // Every lane's stores of the row visible system-wide, then lane 0's release.
    __threadfence_system();
    __syncwarp();
    if ((threadIdx.x & 31) == 0) st_release_sys(flag, seq << 32);
}

// Lane 0 of a warp waits until a row flag holds step `want` or later; false (the warp gives
// up) on timeout, or once another warp of the block has timed out (*failed).
__device__ bool wait_row(const u64* flag, u32 want, u64 timeout_ns, volatile int* failed) {
    int ok = 1;
    if ((threadIdx.x & 31) == 0) {
        u64 start = now_ns();
        while ((int)((u32)(ld_acquire_sys(flag) >> 32) - want) < 0) {
            if (*failed || now_ns() - start > timeout_ns) {
                *failed = 1;
                ok = 0;
                break;
            }
            __nanosleep(64);
        }
    }
    ok = __shfl_sync(0xffffffffu, ok, 0);
    // Lane 0's acquire orders the row's bytes before the warp's reads after this.
    __syncwarp();
    return ok != 0;
}

// The send stage (moe_combine_send, and the first half of moe_combine). `local` (rank-major
// only, else 0): this rank's own rows are not copied into its window; the receive stage reads
// them from expert_out (moe_combine passes it to both halves).
__device__ void combine_send_body(const char* expert_out, const char* window, const int* recv_pos,
                                  const int* recv_count, const u64* peers, u64* state, u32 rank, u32 ranks,
                                  u32 max_tokens, u32 k, u32 experts_per_rank, u32 capacity, u32 hidden,
                                  u64 off_cflag, u64 off_meta, u64 off_cx, u32 rank_major, const u64* proxy,
                                  u64* status, u32 local, u32 nblocks, u64 off_crow) {
    if (blockIdx.x == 0) PROBE(status, 10);
    u32 lane = threadIdx.x & 31;
    // Blocks [0, nblocks) send (all of them but in the streamed combine, where off_crow is
    // the row flags' offset; 0 otherwise).
    u32 warps = nblocks * (blockDim.x >> 5);
    u32 meta_words = 1 + 3 * k;
    u64 row_bytes = (u64)hidden * 2;
    int first = (int)(rank * experts_per_rank);
    bool vec = (hidden % 8 == 0) && (((u64)expert_out & 15ull) == 0);
    bool streamed = off_crow != 0;
    // (Read by every block before the last one counts itself done and moves it on.)
    u64 seq = (state[ST_CSEND] + 1) & 0xffffffffull;
    // Work items: (row, segment), so that few rows still use many warps (row_seg_len); whole
    // rows when streamed (a row's flag is raised by the warp that wrote it). Rows by source,
    // or streamed, by slot (every source's first rows first: the order in which each
    // destination sums its tokens).
    u32 chunks = hidden / 8;
    u32 rows = 0, most = 0;
    for (u32 q = 0; q < ranks; ++q) {
        rows += (u32)recv_count[q];
        most = max(most, (u32)recv_count[q]);
    }
    u32 seg_len = vec && !streamed ? row_seg_len(chunks, warps, rows) : chunks;
    u32 segs = vec ? (chunks + seg_len - 1) / seg_len : 1;
    u64 items = blockIdx.x < nblocks ? (u64)ranks * (streamed ? most : max_tokens) * segs : 0;
    for (u64 it = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); it < items; it += warps) {
        u32 i = (u32)(it / segs), seg = (u32)(it % segs);
        u32 s = streamed ? i % ranks : i / max_tokens, slot = streamed ? i / ranks : i % max_tokens;
        i = s * max_tokens + slot;
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
            sum_seg<FAST_K>((V16*)dst, rows, ws, seg * seg_len + lane, min(chunks, (seg + 1) * seg_len));
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
        if (streamed) raise_row((u64*)(base + off_crow) + (u64)sec * max_tokens + slot, seq);
    }
    if (blockIdx.x == 0) PROBE(status, 11);
    if (!last_block(&state[ST_DONE_CSEND], true)) return;
    PROBE(status, 12);
    raise_flags(peers, proxy, rank, ranks, off_cflag, PX_COMBINE, seq, recv_count);
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
// slot of the caller's expert_out) instead of this rank's section of the window. Blocks
// [b0, gridDim.x) sum (all of them but in the streamed combine, where each token waits for
// its rows' flags at off_crow instead of every rank's flag; off_crow 0 otherwise).
__device__ void combine_recv_body(char* out, const char* window, const int* send_slot, u64* state, u64* status,
                                  u32 rank, u32 ranks, u32 max_tokens, u32 hidden, u64 off_cflag, u64 off_cx,
                                  u64 timeout_ns, const u64* proxy, const char* local_out, u32 b0, u64 off_crow) {
    __shared__ int failed;
    if (threadIdx.x == 0) failed = 0;
    if (blockIdx.x == 0) PROBE(status, 14);
    __syncthreads();
    bool streamed = off_crow != 0;
    u32 want = (u32)(state[ST_CRECV] + 1);
    u32 lane = threadIdx.x & 31;
    u32 warps = (gridDim.x - b0) * (blockDim.x >> 5);
    u64 row_bytes = (u64)hidden * 2;
    bool vec = (hidden % 8 == 0) && (((u64)out & 15ull) == 0);
    u32 chunks = hidden / 8;
    // Before the flags, what this rank wrote itself in its dispatch: the step's tokens and
    // the slots of the warp's first token, so that after them only the partial rows are
    // loaded (one load in the chain instead of three where each warp has one token).
    u32 num_tokens = (u32)state[ST_TOKENS];
    u32 seg_len = vec ? row_seg_len(chunks, warps, num_tokens) : chunks;
    u32 segs = vec ? (chunks + seg_len - 1) / seg_len : 1;
    u64 items = (u64)num_tokens * segs;
    u64 it = blockIdx.x >= b0 ? (blockIdx.x - b0) * (blockDim.x >> 5) + (threadIdx.x >> 5) : items;
    int pslot[FAST_R];
    bool have0 = vec && ranks <= FAST_R && it < items;
#pragma unroll
    for (int d = 0; d < FAST_R; ++d) pslot[d] = have0 && (u32)d < ranks ? send_slot[(it / segs) * ranks + d] : -1;
    if (threadIdx.x < ranks && !streamed) {
        if (px_wait(proxy, PX_COMBINE, threadIdx.x, want, PX_WRITES_COMBINE, timeout_ns, &failed)) {
            wait_seq((const u64*)(window + off_cflag) + threadIdx.x, want, timeout_ns, &failed);
        }
    }
    __syncthreads();
    if (blockIdx.x == 0) PROBE(status, 15);
    __threadfence();
    if (failed) {
        if (threadIdx.x == 0) report(status, ERR_COMBINE_TIMEOUT, blockIdx.x);
    } else if (blockIdx.x >= b0) {
        const u64* crow = (const u64*)(window + off_crow);
        for (; it < items; it += warps) {
            u32 t = (u32)(it / segs), seg = (u32)(it % segs);
            char* dst = out + (u64)t * row_bytes;
            const int* slots = send_slot + (u64)t * ranks;
            if (streamed) {
                // Every partial row of the token landed (this rank's own are in local_out).
                bool ok = true;
                for (u32 d = 0; d < ranks && ok; ++d) {
                    int slot = slots[d];
                    if (slot >= 0 && !(local_out && d == rank)) {
                        ok = wait_row(crow + (u64)d * max_tokens + slot, want, timeout_ns, &failed);
                    }
                }
                if (!ok) {
                    if (lane == 0) report(status, ERR_COMBINE_TIMEOUT, blockIdx.x);
                    break;
                }
            }
            if (vec && ranks <= FAST_R) {
                const V16* rows[FAST_R];
                float ones[FAST_R];
#pragma unroll
                for (int d = 0; d < FAST_R; ++d) {
                    int slot = have0 ? pslot[d] : (u32)d < ranks ? slots[d] : -1;
                    rows[d] = slot < 0 ? (const V16*)0 : (const V16*)partial(window, off_cx, local_out, rank, d, max_tokens, slot, row_bytes);
                    ones[d] = 1.0f;
                }
                sum_seg<FAST_R>((V16*)dst, rows, ones, seg * seg_len + lane, min(chunks, (seg + 1) * seg_len));
                have0 = false;
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
                                            u64 off_cx, u32 rank_major, const u64* proxy, u64* status,
                                            u64 off_crow) {
    // (off_crow: the row flags too, where the ranks agreed to stream the combine, so that a
    // peer's fused combine may stream whichever way this rank launched its stages.)
    combine_send_body(expert_out, window, recv_pos, recv_count, peers, state, rank, ranks, max_tokens, k,
                      experts_per_rank, capacity, hidden, off_cflag, off_meta, off_cx, rank_major, proxy, status,
                      0, gridDim.x, off_crow);
}

extern "C" __global__ void __launch_bounds__(256, 2) moe_combine_recv(char* out, const char* window, const int* send_slot, u64* state,
                                            u64* status, u32 rank, u32 ranks, u32 max_tokens, u32 hidden,
                                            u64 off_cflag, u64 off_cx, u64 timeout_ns, const u64* proxy) {
    combine_recv_body(out, window, send_slot, state, status, rank, ranks, max_tokens, hidden, off_cflag, off_cx,
                      timeout_ns, proxy, (const char*)0, 0, 0);
}

// Both stages in one launch (AllToAll::combine without proxy ranks), as moe_dispatch: every
// block resident at once. Rank-major, this rank's own rows stay in expert_out (no copy
// through the window). Streamed (0 < send_blocks < gridDim.x, off_crow the row flags):
// blocks [0, send_blocks) send, a flag per row, while the others sum each token as soon as
// its rows have landed, so that the sums overlap the send (prefill: bandwidth-bound on both
// sides, NVLink for the send, HBM for the sums) instead of following it.
extern "C" __global__ void __launch_bounds__(256, 2) moe_combine(const char* expert_out, const char* window, const int* recv_pos,
                                       const int* recv_count, const u64* peers, u64* state, u32 rank, u32 ranks,
                                       u32 max_tokens, u32 k, u32 experts_per_rank, u32 capacity, u32 hidden,
                                       u64 off_cflag, u64 off_meta, u64 off_cx, u32 rank_major, const u64* proxy,
                                       u64* status, char* out, const int* send_slot, u64 timeout_ns,
                                       u32 send_blocks, u64 off_crow) {
    // (The receive's 16 B loads of expert_out need it aligned, as the send's.)
    u32 local = rank_major && ((u64)expert_out & 15ull) == 0;
    bool streamed = send_blocks > 0 && send_blocks < gridDim.x && off_crow != 0;
    combine_send_body(expert_out, window, recv_pos, recv_count, peers, state, rank, ranks, max_tokens, k,
                      experts_per_rank, capacity, hidden, off_cflag, off_meta, off_cx, rank_major, proxy, status,
                      local, streamed ? send_blocks : gridDim.x, streamed ? off_crow : 0);
    combine_recv_body(out, window, send_slot, state, status, rank, ranks, max_tokens, hidden, off_cflag, off_cx,
                      timeout_ns, proxy, local ? expert_out : (const char*)0, streamed ? send_blocks : 0,
                      streamed ? off_crow : 0);
}
