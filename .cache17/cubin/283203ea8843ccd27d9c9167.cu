// stof-cc masked multi-head attention: stof_attn_wgmma_ws_bfloat16_d128_m128_n128_w8_s2_persistent
// strategy: wgmma_ws  dtype: bfloat16  head_dim: 128
// block_m: 128  block_n: 128  stages: 2
// consumer warps: 8 (2 warpgroup(s)) + 1 producer warpgroup
//
// Hopper (sm_90a), warp-specialised. The wgmma kernel's walk over the block row's non-empty
// key blocks (FULL blocks take no mask test, PARTIAL blocks read their bit tile), but the CTA's
// warpgroups no longer meet at a CTA-wide barrier every block:
// * one thread of the producer warpgroup (the last one; 24 registers after setmaxnreg) copies
//   Q once per tile, then K(j) and V(j - 1) into a ring of STAGES buffers with TMA (tensor maps of
//   Q, K and V encoded on the host; rows past the sequence end read as zeros), each copy
//   completing the bytes of a "full" mbarrier, and waits on the "empty" mbarrier of a buffer
//   before it overwrites it (with cp.async, the whole warpgroup's address arithmetic took a
//   quarter of the kernel's issue slots at d = 128 and the consumers waited on it). It also reads
//   the schedule and the mask's index for the consumers: a tile's description (head, batch slot,
//   block row, block count, key-padding range) travels in shared memory with its Q, a block's
//   (key column, partial-tile index) with its K, and a PARTIAL block's bit tile is copied in
//   beside its K (a bulk copy on the same barrier), so the consumers read no global memory but
//   for their output (their chains of dependent index loads cost sliding windows, whose tiles
//   are short, a quarter of their stall samples);
// * each consumer warpgroup owns 64 query rows and runs the wgmma kernel's software pipeline
//   (issue S(i+1) = Q K(i+1)^T and O += P(i) V(i), softmax of S(i+1) while P(i) V(i) runs),
//   waiting on a buffer's full barrier before its first read and arriving on its empty barrier
//   (one arrival per warp) once the wgmma that read it has completed.
// TMA writes and wgmma reads are both in the async proxy: a full barrier needs no proxy fence.
// Consumer warpgroups take turns (ping-pong, named barriers 1 + w): warpgroup w issues S(i+1) and
// P(i) V(i) only on its turn, then hands the turn on, so one warpgroup's softmax runs while the
// next one's matrix products occupy the tensor cores.
// Each CTA runs a list of tiles (head, batch element, block row) from the host's schedule (passed
// as row_order: gridDim.x + 1 offsets, then per tile an entry: h, b, block row and its range of
// the mask's block list): one tile per CTA
// on the hardware's schedule, or a persistent CTA per SM taking its share, longest first. The
// mbarrier rings, the two Q buffers (tiles alternate) and the turns run on across tiles, so the
// producer loads the next tile's Q while this tile's S still read the other buffer, and its K/V as
// ring slots free up. A row with no allowed key writes 0.
// The output goes through shared memory: once a warpgroup's last P V of a tile has completed, it writes
// its 64 rows, normalised, into its own rows of the tile's Q buffer (its S have all completed; the
// 128-byte swizzle of the Q map's boxes), and one thread stores them with TMA (the O map) while the
// warpgroup goes on to its next tile; that thread hands the buffer back to the producer (q_empty) once
// the store has read it, after the next tile's first S is issued. Direct 4-byte stores of the rows took
// a tenth of the consumers' stall samples on short causal tiles (S = 512, d = 128: the store queue full).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

// Programmatic dependent launch (sm_90+; no-ops before): wait until the grids this one depends on have
// completed and their writes are visible; then let the next grid's CTAs start their set-up while this one runs
// (they wait in turn before touching memory). Without a PDL launch both return at once.
__device__ __forceinline__ void wait_for_producer_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}


typedef __nv_bfloat16 elem_t;
typedef __nv_bfloat162 elem2_t;
#define MMA_TYPE "bf16"
__device__ __forceinline__ elem2_t pack2(float a, float b) { return __floats2bfloat162_rn(a, b); }
__device__ __forceinline__ float2 unpack2(elem2_t v) { return __bfloat1622float2(v); }


#define HEAD_DIM 128
#define BLOCK_M 128
#define BLOCK_N 128
#define WARPS 8
#define MT 1
#define STAGES 2
#define THREADS (WARPS * 32)
#define TILE_WORDS ((BLOCK_M * BLOCK_N + 31) / 32)
#define ROW_WORDS (BLOCK_N / 32)

// Tiles are stored in 64-element (128-byte) column blocks of 128-byte-swizzled rows, the layout
// wgmma descriptors read: a tile of R rows takes R * HEAD_DIM elements and starts 1024-byte aligned.
#define TILE_ELEMS(rows) ((rows) * HEAD_DIM)


static_assert(BLOCK_M == WARPS * 16 * MT, "each warp owns 16 * MT query rows");
static_assert(BLOCK_N % 32 == 0 && HEAD_DIM % 16 == 0, "a tile row is whole 32-bit mask words; d is mma-sized");

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 zero-fills (rows past the sequence end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// The first index in [lo, hi) whose block column is >= col (block columns ascend along a row).
__device__ __forceinline__ int first_block_from(const int* cols, int lo, int hi, int col) {
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (cols[mid] < col) lo = mid + 1; else hi = mid;
    }
    return lo;
}

__device__ __forceinline__ uint32_t as_u32(elem2_t v) { return *reinterpret_cast<uint32_t*>(&v); }

// Copy `ROWS` rows of HEAD_DIM elements (row stride `stride` elements) into a shared-memory tile;
// every thread of the CTA takes part (`tid`). Each thread keeps one 16-byte column chunk and
// steps down the rows, so its addresses advance by constants: a copy costs a handful of
// instructions, not a division and a 64-bit multiply per chunk.
template <int ROWS>
__device__ __forceinline__ void load_tile(elem_t* smem, const elem_t* gmem, long long stride,
                                          int first_row, int seq_len, int tid) {
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per row
    static_assert(THREADS % CHUNKS == 0, "every thread keeps one column chunk");
    constexpr int ROWS_PER_PASS = THREADS / CHUNKS;
    const int chunk = tid % CHUNKS, r0 = tid / CHUNKS;
    const elem_t* src = gmem + (long long)(first_row + r0) * stride + chunk * 8;
    const long long pass_stride = (long long)ROWS_PER_PASS * stride;
    #pragma unroll 8
    for (int pass = 0; pass < (ROWS + ROWS_PER_PASS - 1) / ROWS_PER_PASS; ++pass, src += pass_stride) {
        const int r = r0 + pass * ROWS_PER_PASS;
        if (ROWS % ROWS_PER_PASS != 0 && r >= ROWS) break;
        const bool in_range = first_row + r < seq_len;

        // column block chunk / 8, then row r's chunk (chunk % 8) XOR-swizzled by r % 8
        elem_t* dst = smem + (chunk / 8) * ROWS * 64 + r * 64 + (((chunk % 8) ^ (r % 8)) * 8);

        cp_async16(dst, in_range ? src : gmem, in_range ? 16 : 0);
    }
}

#define PRODUCER_THREADS 128
#define TILE_ENTRY 5  // ints per tile in the schedule (backends.tile_schedule.TILE_ENTRY)
#define LAUNCH_THREADS (THREADS + PRODUCER_THREADS)
#define STORER ((threadIdx.x & 127) == 0)  // a consumer warpgroup's first thread issues its output stores
static_assert(MT == 1 && WARPS % 4 == 0 && HEAD_DIM % 64 == 0, "a warpgroup owns 64 rows; d is whole 128-byte blocks");
static_assert(STAGES >= 2, "the producer runs at least one block ahead");


// Registers move from the producer to the consumers (65536 per SM, one CTA per SM).
#define PRODUCER_REGS 24
#define CONSUMER_REGS 240


// wgmma shared-memory matrix descriptor, 128-byte swizzle: start address, leading-dimension
// byte offset (between 64-element column blocks of an MN-major operand; unused for K-major),
// stride byte offset 1024 (between groups of 8 rows). The high word (stride and swizzle) is every operand's.
constexpr uint64_t SW128_DESC_HIGH = ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
__device__ __forceinline__ uint64_t sw128_desc(const void* p, uint32_t lead_bytes) {
    return (uint64_t)((smem_addr(p) & 0x3FFFF) >> 4) | ((uint64_t)((lead_bytes >> 4) & 0x3FFF) << 16) | SW128_DESC_HIGH;
}
// Loops address their operands from one encoded descriptor: the descriptor `units` 16-byte steps past
// `base` (its start-address field counts 16 bytes in 14 bits and never carries, shared addresses
// staying below 256 KB). Encoding a descriptor costs about 20 instructions; this, one 64-bit add, which
// stays in uniform registers where `base` is warp-uniform to the compiler (built from blockIdx, constants
// and values broadcast with __shfl_sync from lane 0, never from threadIdx or a per-thread load): else
// each wgmma pays two R2UR moves and the add in vector registers, in the attention kernels between the
// wgmmas a warpgroup issues on its turn (benchmarks/history/25-2026-11-27.md).
__device__ __forceinline__ uint64_t sw128_desc_plus(uint64_t base, uint32_t units) { return base + units; }
// The same from a descriptor's low word (the high word is SW128_DESC_HIGH), with a 32-bit add: for a base
// kept per thread (the GEMM's, from its warpgroup's rows), where 64-bit bases cost registers (109 -> 123
// at co_m128_n256_s4) and the GEMM's long wgmmas hide the moves.
__device__ __forceinline__ uint64_t sw128_desc_plus_low(uint32_t low, uint32_t units) { return SW128_DESC_HIGH | (low + units); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// cp.async writes through the generic proxy; wgmma reads through the async one.
__device__ __forceinline__ void fence_async_proxy() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Pin accumulator registers at a point, so the compiler moves no access across a wgmma issue or wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N][4]) {
    #pragma unroll
    for (int j = 0; j < N; ++j)
        asm volatile("" : "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3]) :: "memory");
}
// S[64 x BLOCK_N] (+)= Q[64 x 16] K[BLOCK_N x 16]^T: both operands K-major in shared memory.
__device__ __forceinline__ void wgmma_qk(float (&d)[BLOCK_N / 8][4], uint64_t desc_q, uint64_t desc_k, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
"wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_TYPE "." MMA_TYPE " { ""%0,""%1,""%2,""%3,""%4,""%5,""%6,""%7,""%8,""%9,""%10,""%11,""%12,""%13,""%14,""%15,""%16,""%17,""%18,""%19,""%20,""%21,""%22,""%23,""%24,""%25,""%26,""%27,""%28,""%29,""%30,""%31,""%32,""%33,""%34,""%35,""%36,""%37,""%38,""%39,""%40,""%41,""%42,""%43,""%44,""%45,""%46,""%47,""%48,""%49,""%50,""%51,""%52,""%53,""%54,""%55,""%56,""%57,""%58,""%59,""%60,""%61,""%62,""%63"" }, ""%64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "l"(desc_q), "l"(desc_k), "r"(accumulate));
}
// O[64 x HEAD_DIM] += P[64 x 16] (registers) V[16 x HEAD_DIM]: V is MN-major (transposed B).
__device__ __forceinline__ void wgmma_pv(float (&d)[HEAD_DIM / 8][4], const uint32_t (&a)[4], uint64_t desc_v) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
"wgmma.mma_async.sync.aligned.m64n128k16.f32." MMA_TYPE "." MMA_TYPE " { ""%0,""%1,""%2,""%3,""%4,""%5,""%6,""%7,""%8,""%9,""%10,""%11,""%12,""%13,""%14,""%15,""%16,""%17,""%18,""%19,""%20,""%21,""%22,""%23,""%24,""%25,""%26,""%27,""%28,""%29,""%30,""%31,""%32,""%33,""%34,""%35,""%36,""%37,""%38,""%39,""%40,""%41,""%42,""%43,""%44,""%45,""%46,""%47,""%48,""%49,""%50,""%51,""%52,""%53,""%54,""%55,""%56,""%57,""%58,""%59,""%60,""%61,""%62,""%63"" }, ""{ %64, %65, %66, %67 }, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_v), "r"(1));
}

// Issue (not commit, not wait for) S = Q K^T over head_dim for this warpgroup's rows.
__device__ __forceinline__ void issue_qk(float (&s)[BLOCK_N / 8][4], const elem_t* q_rows, const elem_t* k_tile) {
    fence_regs(s);
    wgmma_fence();
    const uint64_t q0 = sw128_desc(q_rows, 16), k0 = sw128_desc(k_tile, 16);  // then offsets (16 bytes)
    #pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; ++kk) {
        const int cb = kk / 4, within = (kk % 4) * 16;  // 64-element column block, offset inside it
        wgmma_qk(s, sw128_desc_plus(q0, (cb * BLOCK_M * 64 + within) * sizeof(elem_t) / 16),
                 sw128_desc_plus(k0, (cb * BLOCK_N * 64 + within) * sizeof(elem_t) / 16), kk > 0);
    }
}

// mbarrier phases: a wait for phase parity p returns once the phase with that parity completed.
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
    uint32_t done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    } while (!done);
}

struct alignas(64) TensorMap { unsigned long long opaque[16]; };  // CUtensorMap, encoded on the host
// Arrive on bar, expecting `bytes` more to land from TMA copies before its phase completes.
__device__ __forceinline__ void mbar_expect_bytes(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Copy the box at (column col, row row) of the tensor map's matrix into shared memory (swizzled by
// the map; rows and columns past the edges read as zeros); completes bytes on bar.
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, int col, int row, uint64_t* bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3 }], [%4];\n"
                 :: "r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(smem_addr(bar))
                 : "memory");
}
// The same for a 5-D map over [batch, head, residue, row, column] (`tensor_map.encode_heads`; one
// residue but for a strided split): rows past the sequence end of this (batch, head, residue) read as zeros.
__device__ __forceinline__ void tma_load_head(void* dst, const TensorMap* map, int col, int row, int residue, int head,
                                              int batch, uint64_t* bar) {
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, { %2, %3, %4, %5, %6 }], [%7];\n"
                 :: "r"(smem_addr(dst)), "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(residue), "r"(head),
                    "r"(batch), "r"(smem_addr(bar))
                 : "memory");
}

// Store the box at (column col, row row) of the output's tensor map from shared memory (rows and columns
// past the edges are not written); one bulk group per call site's commit.
__device__ __forceinline__ void tma_store(const TensorMap* map, const void* src, int col, int row) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, { %1, %2 }], [%3];\n"
                 :: "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(smem_addr(src)) : "memory");
}
// The same for a 5-D map over [batch, head, residue, row, column] (`tensor_map.encode_heads`): rows past
// the sequence end of this (batch, head, residue) are not written.
__device__ __forceinline__ void tma_store_head(const TensorMap* map, const void* src, int col, int row, int residue,
                                               int head, int batch) {
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, { %1, %2, %3, %4, %5 }], [%6];\n"
                 :: "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(residue), "r"(head), "r"(batch),
                    "r"(smem_addr(src)) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The committed stores have read their shared memory (it may be overwritten) / have completed.
// (With PENDING > 0: all but the last PENDING committed stores have read theirs.)
template <int PENDING>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(PENDING) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Arrive on bar `count` times at once (a warpgroup's storing thread, for its four warps).
__device__ __forceinline__ void mbar_arrive_count(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" :: "r"(smem_addr(bar)), "r"(count) : "memory");
}

// A ROWS x HEAD_DIM tile from row `row` of (batch, head, residue) through `map`, in 64-column blocks of
// 128-byte-swizzled rows (the layout the wgmma descriptors read); completes its bytes on bar.
template <int ROWS>
__device__ __forceinline__ void load_head_tile(elem_t* smem, const TensorMap* map, int row, int residue, int head,
                                               int batch, uint64_t* bar) {
    mbar_expect_bytes(bar, ROWS * HEAD_DIM * sizeof(elem_t));  // whole boxes: zero-filled rows count
    #pragma unroll
    for (int cb = 0; cb < HEAD_DIM / 64; ++cb) tma_load_head(smem + cb * ROWS * 64, map, cb * 64, row, residue, head, batch, bar);
}

// A PARTIAL block's bit tile (TILE_WORDS words) into shared memory, completing its bytes on bar (one
// more transaction count on a barrier whose arrival load_head_tile makes). The consumers read the
// buffer's last tile with ordinary loads (the generic proxy) and the bulk copy writes it through the
// async proxy: the mbarrier handshake orders the two only with a proxy fence between them. (Without
// it, 3 launches of BigBird at d = 128, n = 64, 3 stages, persistent came out wrong in two long A/B
// runs on the H100; none did in isolation, so this fence is the likely cause, not a proven one.)
__device__ __forceinline__ void load_bits(uint32_t* dst, const uint32_t* src, uint64_t* bar) {
    fence_async_proxy();
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" :: "r"(smem_addr(bar)), "n"(TILE_WORDS * 4)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 :: "r"(smem_addr(dst)), "l"(src), "n"(TILE_WORDS * 4), "r"(smem_addr(bar)) : "memory");
}

// Ping-pong: consumer warpgroup w issues its wgmmas only on its turn (named barrier 1 + w) and
// then hands the turn to the next, so one warpgroup's softmax runs under another's matrix products.
#define CONSUMER_WGS 2
__device__ __forceinline__ void wait_turn(int wg) { asm volatile("bar.sync %0, 256;\n" :: "r"(1 + wg) : "memory"); }
__device__ __forceinline__ void pass_turn(int wg) { asm volatile("bar.arrive %0, 256;\n" :: "r"(1 + (wg + 1) % CONSUMER_WGS) : "memory"); }

extern "C" __global__ void __launch_bounds__(LAUNCH_THREADS)
stof_attn_wgmma_ws_bfloat16_d128_m128_n128_w8_s2_persistent(const __grid_constant__ TensorMap q_map, const __grid_constant__ TensorMap k_map,
     const __grid_constant__ TensorMap v_map, const __grid_constant__ TensorMap o_map, const elem_t* __restrict__ Q, const elem_t* __restrict__ K,
     const elem_t* __restrict__ V, elem_t* __restrict__ O,
     const int* __restrict__ any_ptr, const int* __restrict__ any_cols,
     const int* __restrict__ any_tile, const uint32_t* __restrict__ part_bits,
     const int* __restrict__ row_order, const int* __restrict__ key_range,
     const unsigned char* __restrict__ key_valid, int seq_q, int seq_k,
     long long q_sb, long long q_sh, long long q_ss, long long q_sr,
     long long k_sb, long long k_sh, long long k_ss, long long k_sr,
     long long v_sb, long long v_sh, long long v_ss, long long v_sr,
     long long o_sb, long long o_sh, long long o_ss, long long o_sr,
     int mask_rows_per_batch, int mask_rows_per_head, float scale_log2, unsigned kv_head_magic,
     int residues, unsigned residue_magic,
     const elem_t* __restrict__ bias, long long bias_sb, long long bias_sh, long long bias_sq, float bias_to_raw,
     float* __restrict__ lse, long long l_sb, long long l_sh, long long l_ss, long long l_sr)
{
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // swizzled tiles must start 1024-byte aligned (the launch reserves 1 KB of slack for this)
    elem_t* sQ = reinterpret_cast<elem_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
    elem_t* sK = sQ + 2 * TILE_ELEMS(BLOCK_M);  // two Q buffers, then the K ring
    elem_t* sV = sK + STAGES * TILE_ELEMS(BLOCK_N);
    uint32_t* sBits = reinterpret_cast<uint32_t*>(sV + STAGES * TILE_ELEMS(BLOCK_N));  // a bit tile per stage
    // What the producer tells the consumers: per Q buffer its tile (head, batch slot, block row, block
    // count, kv_start, kv_end, kv_holes); per stage its block (partial-tile index or -1, first key).
    __shared__ int tile_info[2][8];
    __shared__ int2 block_info[STAGES];
    // q_full, q_empty per Q buffer; k_full, v_full, k_empty, v_empty per stage
    __shared__ __align__(8) uint64_t bars[4 + 4 * STAGES];
    uint64_t* q_full = bars;
    uint64_t* q_empty = bars + 2;
    uint64_t* k_full = bars + 4;
    uint64_t* v_full = k_full + STAGES;
    uint64_t* k_empty = v_full + STAGES;
    uint64_t* v_empty = k_empty + STAGES;
    if (threadIdx.x == 0) {
        for (int buffer = 0; buffer < 2; ++buffer) {
            mbar_init(q_full + buffer, 1);
            mbar_init(q_empty + buffer, WARPS);
        }
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(k_full + st, 1);
            mbar_init(v_full + st, 1);
            mbar_init(k_empty + st, WARPS);
            mbar_init(v_empty + st, WARPS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();  // the last CTA-wide barrier: from here warpgroups meet only at mbarriers

wait_for_producer_grids();  // PDL: before the first global access (the mask's rows included)
    allow_dependent_grids();
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane >> 2, t = lane & 3;  // accumulator fragment coordinates
    const int warp_row0 = warp * 16 * MT;  // first row of this warp inside the block row
    // this CTA's tiles: schedule[blockIdx.x] .. schedule[blockIdx.x + 1] of the entries after the offsets
    const int* schedule = row_order;
    const int tiles_begin = schedule[blockIdx.x];

    const int tiles_end = schedule[blockIdx.x + 1];

    const int* tiles = schedule + gridDim.x + 1;

    if (threadIdx.x >= THREADS) {  // ---- producer warpgroup ----

        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" :: "n"(PRODUCER_REGS));

        if (threadIdx.x != THREADS) return;  // one thread issues every copy
        int loaded = 0, tiles_done = 0;  // K/V blocks and tiles loaded for earlier tiles
        for (int ti = tiles_begin; ti < tiles_end; ++ti) {
            // the tile's entry: head, batch slot, block row, its blocks' range [first, last) of any_cols / any_tile
            const int* entry = tiles + TILE_ENTRY * ti;
            const int h = entry[0], batch_slot = entry[1], block_row = entry[2];
            int first = entry[3], last = entry[4];
            const int q0 = block_row * BLOCK_M;
        
            const int b = batch_slot, r = 0;  // one residue: the slot is the batch element

        // grouped-query: h // group by a multiply (kv_head_magic = ceil(2^32 / group), exact for h < 2^32 / group;
            // 0 for one K/V head per query head). A division here cost ptxas 36 more registers.
            const int kv_h = kv_head_magic == 0u ? h : (int)__umulhi((unsigned)h, kv_head_magic);
            int kv_start = 0, kv_end = seq_k, kv_holes = 0;
            if (key_range != nullptr) {  // key padding (per batch slot): only the blocks that overlap [kv_start, kv_end)
                kv_start = key_range[3 * batch_slot];
                kv_end = key_range[3 * batch_slot + 1];
                kv_holes = key_range[3 * batch_slot + 2];
                first = first_block_from(any_cols, first, last, kv_start / BLOCK_N);
                last = first_block_from(any_cols, first, last, (kv_end + BLOCK_N - 1) / BLOCK_N);
            }
            const int n_blocks = last - first;
            // each block's partial-tile index and column, read one block ahead of its copy
            int next_tile = n_blocks > 0 ? any_tile[first] : -1, next_col = n_blocks > 0 ? any_cols[first] : 0;
            const int q_slot = tiles_done % 2;  // free once the output store of the tile before last has read it
            if (tiles_done >= 2) mbar_wait(q_empty + q_slot, ((tiles_done / 2) - 1) & 1);
            int* info = tile_info[q_slot];  // published by the arrival on q_full (a release)
            info[0] = h;
            info[1] = batch_slot;
            info[2] = block_row;
            info[3] = n_blocks;
            info[4] = kv_start;
            info[5] = kv_end;
            info[6] = kv_holes;
            if (n_blocks > 0) load_head_tile<BLOCK_M>(sQ + q_slot * TILE_ELEMS(BLOCK_M), &q_map, q0, r, h, b, q_full + q_slot);
            else mbar_arrive(q_full + q_slot);  // no key block: the description alone (the consumers write zeros)
            ++tiles_done;
            // K(j) then V(j - 1): the order the consumers read them in
            int key0 = 0;
            for (int j = 0; j <= n_blocks; ++j) {
                const int v_key0 = key0;
                if (j < n_blocks) {
                    const int ring = loaded + j, st = ring % STAGES;
                    const int tile = next_tile;
                    key0 = next_col * BLOCK_N;
                    if (j + 1 < n_blocks) {
                        next_tile = any_tile[first + j + 1];
                        next_col = any_cols[first + j + 1];
                    }
                    if (ring >= STAGES) mbar_wait(k_empty + st, ((ring / STAGES) - 1) & 1);
                    block_info[st] = make_int2(tile, key0);
                    if (tile >= 0) load_bits(sBits + st * TILE_WORDS, part_bits + (long long)tile * TILE_WORDS, k_full + st);
                    load_head_tile<BLOCK_N>(sK + st * TILE_ELEMS(BLOCK_N), &k_map, key0, r, kv_h, b, k_full + st);
                }
                if (j >= 1) {
                    const int ring = loaded + j - 1, st = ring % STAGES;
                    if (ring >= STAGES) mbar_wait(v_empty + st, ((ring / STAGES) - 1) & 1);
                    load_head_tile<BLOCK_N>(sV + st * TILE_ELEMS(BLOCK_N), &v_map, v_key0, r, kv_h, b, v_full + st);
                }
            }
            loaded += n_blocks;
        }
        return;  // every copy it issued completes on a barrier the consumers wait for
    }

    // ---- consumer warpgroups ----

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" :: "n"(CONSUMER_REGS));

    const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);

    int staged_q = -1;  // the Q buffer holding this warpgroup's last output, until its store has read it

    int done = 0, tiles_done = 0, q_uses = 0;  // K/V blocks, tiles, and tiles with key blocks consumed before
    for (int ti = tiles_begin; ti < tiles_end; ++ti) {
    const int q_slot = tiles_done % 2;
    mbar_wait(q_full + q_slot, (tiles_done / 2) & 1);  // this tile's description (and Q, if it has key blocks)
    ++tiles_done;
    const int h = tile_info[q_slot][0], batch_slot = tile_info[q_slot][1], block_row = tile_info[q_slot][2];
    const int n_blocks = tile_info[q_slot][3], kv_start = tile_info[q_slot][4], kv_end = tile_info[q_slot][5];
    const int kv_holes = tile_info[q_slot][6];
    const int q0 = block_row * BLOCK_M;

    const int b = batch_slot, r = 0;  // one residue: the slot is the batch element

float acc_o[MT][HEAD_DIM / 8][4];
    float row_max[MT][2], row_sum[MT][2];  // row_max is in raw-score units (before scaling)
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int j = 0; j < HEAD_DIM / 8; ++j) acc_o[mt][j][0] = acc_o[mt][j][1] = acc_o[mt][j][2] = acc_o[mt][j][3] = 0.f;
        row_max[mt][0] = row_max[mt][1] = -INFINITY;
        row_sum[mt][0] = row_sum[mt][1] = 0.f;
    }
    float s[MT][BLOCK_N / 8][4];         // scores of the block in flight, then its probabilities
    float alpha[MT][2];                  // rescale of O owed by the last softmax
    uint32_t pf[BLOCK_N / 16][4];        // P(i), packed: wgmma's register operand
    uint32_t words[MT][2][ROW_WORDS];
    const elem_t* q_rows = sQ + q_slot * TILE_ELEMS(BLOCK_M) + wg * 64 * 64;  // this warpgroup's rows, column block 0
    if (n_blocks > 0) {  // prologue: S(0) and its softmax
        const int stage = done % STAGES;
        mbar_wait(k_full + stage, (done / STAGES) & 1);
        const int tile = block_info[stage].x, key0 = block_info[stage].y;
if (tile >= 0) {
            const uint32_t* bits = sBits + stage * TILE_WORDS;
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int rr = 0; rr < 2; ++rr)
                    #pragma unroll
                    for (int w = 0; w < ROW_WORDS; ++w)
                        words[mt][rr][w] = bits[(warp_row0 + mt * 16 + g + rr * 8) * ROW_WORDS + w];
        }
        // warpgroup 0 takes the first turn: the last one hands it over before its first wait
        if (q_uses == 0 && wg == CONSUMER_WGS - 1) pass_turn(wg);
        wait_turn(wg);
        issue_qk(s[0], q_rows, sK + stage * TILE_ELEMS(BLOCK_N));
        wgmma_commit();
        pass_turn(wg);

        if (staged_q >= 0) {
            if (STORER) {
                bulk_wait_read<0>();
                mbar_arrive_count(q_empty + staged_q, 4);
            }
            staged_q = -1;
        }

        wgmma_wait<0>();
        fence_regs(s[0]);
        if (lane == 0) mbar_arrive(k_empty + stage);

        if (tile >= 0) {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int rr = 0; rr < 2; ++rr)
                    #pragma unroll
                    for (int j = 0; j < BLOCK_N / 8; ++j)
                        #pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int c = j * 8 + 2 * t + e;
                            if (!((words[mt][rr][c / 32] >> (c % 32)) & 1u)) s[mt][j][2 * rr + e] = -INFINITY;
                        }
        }
        if (key0 < kv_start || key0 + BLOCK_N > kv_end) {  // the sequence end, or key padding
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int j = 0; j < BLOCK_N / 8; ++j)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key0 + j * 8 + 2 * t + (e % 2);
                        if (key < kv_start || key >= kv_end) s[mt][j][e] = -INFINITY;
                    }
        }
        if (kv_holes) {  // padding between attended keys: test each key (uniform branch, rare)
            const unsigned char* valid = key_valid + (long long)batch_slot * seq_k;
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int j = 0; j < BLOCK_N / 8; ++j)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key0 + j * 8 + 2 * t + (e % 2);
                        if (key < kv_end && !valid[key]) s[mt][j][e] = -INFINITY;
                    }
        }
float first_alpha[MT][2];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                float mx = row_max[mt][rr];
                #pragma unroll
                for (int j = 0; j < BLOCK_N / 8; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * rr], s[mt][j][2 * rr + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float ref = (mx == -INFINITY) ? 0.f : mx * scale_log2;  // fully masked so far: no NaN
                first_alpha[mt][rr] = exp2f(row_max[mt][rr] * scale_log2 - ref);
                row_max[mt][rr] = mx;
                float sum = 0.f;
                #pragma unroll
                for (int j = 0; j < BLOCK_N / 8; ++j) {
                    s[mt][j][2 * rr] = exp2f(fmaf(s[mt][j][2 * rr], scale_log2, -ref));
                    s[mt][j][2 * rr + 1] = exp2f(fmaf(s[mt][j][2 * rr + 1], scale_log2, -ref));
                    sum += s[mt][j][2 * rr] + s[mt][j][2 * rr + 1];
                }
                row_sum[mt][rr] = row_sum[mt][rr] * first_alpha[mt][rr] + sum;
            }
        alpha[0][0] = first_alpha[0][0];
        alpha[0][1] = first_alpha[0][1];
    } else {

        if (staged_q >= 0) {
            if (STORER) {
                bulk_wait_read<0>();
                mbar_arrive_count(q_empty + staged_q, 4);
            }
            staged_q = -1;
        }

    }
    // Every block but the last issues S(i+1); the last block is peeled off, since a wgmma issued
    // under a branch makes ptxas serialise every wgmma of the kernel (its advisory C7515).
    int i = 0;
    for (; i + 1 < n_blocks; ++i) {
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            pf[kk][0] = as_u32(pack2(s[0][2 * kk][0], s[0][2 * kk][1]));
            pf[kk][1] = as_u32(pack2(s[0][2 * kk][2], s[0][2 * kk][3]));
            pf[kk][2] = as_u32(pack2(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]));
            pf[kk][3] = as_u32(pack2(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]));
        }
        const int ring = done + i;

        const int k_stage = (ring + 1) % STAGES;
        mbar_wait(k_full + k_stage, ((ring + 1) / STAGES) & 1);
        const int tile = block_info[k_stage].x, key0 = block_info[k_stage].y;
        wait_turn(wg);
        issue_qk(s[0], q_rows, sK + k_stage * TILE_ELEMS(BLOCK_N));
        wgmma_commit();

        mbar_wait(v_full + ring % STAGES, (ring / STAGES) & 1);

fence_regs(acc_o[0]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j) {
                acc_o[mt][j][0] *= alpha[mt][0];
                acc_o[mt][j][1] *= alpha[mt][0];
                acc_o[mt][j][2] *= alpha[mt][1];
                acc_o[mt][j][3] *= alpha[mt][1];
            }
        {
            const elem_t* v_tile = sV + (ring % STAGES) * TILE_ELEMS(BLOCK_N);
            fence_regs(acc_o[0]);
            wgmma_fence();
            const uint64_t v0 = sw128_desc(v_tile, BLOCK_N * 128);  // then offsets (16 bytes)
            #pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk)  // keys 16 kk .. 16 kk + 15: two groups of 8 rows
                wgmma_pv(acc_o[0], pf[kk], sw128_desc_plus(v0, kk * 16 * 64 * sizeof(elem_t) / 16));
            wgmma_commit();
        }
        pass_turn(wg);

if (tile >= 0) {
            const uint32_t* bits = sBits + k_stage * TILE_WORDS;
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int rr = 0; rr < 2; ++rr)
                    #pragma unroll
                    for (int w = 0; w < ROW_WORDS; ++w)
                        words[mt][rr][w] = bits[(warp_row0 + mt * 16 + g + rr * 8) * ROW_WORDS + w];
        }
        wgmma_wait<1>();  // S(i+1) done; P(i) V(i) may still run
        fence_regs(s[0]);
        if (lane == 0) mbar_arrive(k_empty + k_stage);

        if (tile >= 0) {
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int rr = 0; rr < 2; ++rr)
                    #pragma unroll
                    for (int j = 0; j < BLOCK_N / 8; ++j)
                        #pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int c = j * 8 + 2 * t + e;
                            if (!((words[mt][rr][c / 32] >> (c % 32)) & 1u)) s[mt][j][2 * rr + e] = -INFINITY;
                        }
        }
        if (key0 < kv_start || key0 + BLOCK_N > kv_end) {  // the sequence end, or key padding
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int j = 0; j < BLOCK_N / 8; ++j)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key0 + j * 8 + 2 * t + (e % 2);
                        if (key < kv_start || key >= kv_end) s[mt][j][e] = -INFINITY;
                    }
        }
        if (kv_holes) {  // padding between attended keys: test each key (uniform branch, rare)
            const unsigned char* valid = key_valid + (long long)batch_slot * seq_k;
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                #pragma unroll
                for (int j = 0; j < BLOCK_N / 8; ++j)
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = key0 + j * 8 + 2 * t + (e % 2);
                        if (key < kv_end && !valid[key]) s[mt][j][e] = -INFINITY;
                    }
        }
float next_alpha[MT][2];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                float mx = row_max[mt][rr];
                #pragma unroll
                for (int j = 0; j < BLOCK_N / 8; ++j) mx = fmaxf(mx, fmaxf(s[mt][j][2 * rr], s[mt][j][2 * rr + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float ref = (mx == -INFINITY) ? 0.f : mx * scale_log2;  // fully masked so far: no NaN
                next_alpha[mt][rr] = exp2f(row_max[mt][rr] * scale_log2 - ref);
                row_max[mt][rr] = mx;
                float sum = 0.f;
                #pragma unroll
                for (int j = 0; j < BLOCK_N / 8; ++j) {
                    s[mt][j][2 * rr] = exp2f(fmaf(s[mt][j][2 * rr], scale_log2, -ref));
                    s[mt][j][2 * rr + 1] = exp2f(fmaf(s[mt][j][2 * rr + 1], scale_log2, -ref));
                    sum += s[mt][j][2 * rr] + s[mt][j][2 * rr + 1];
                }
                row_sum[mt][rr] = row_sum[mt][rr] * next_alpha[mt][rr] + sum;
            }
        alpha[0][0] = next_alpha[0][0];
        alpha[0][1] = next_alpha[0][1];

        wgmma_wait<0>();
        fence_regs(acc_o[0]);
        if (lane == 0) mbar_arrive(v_empty + ring % STAGES);
    }
    if (n_blocks > 0) {
#pragma unroll
        for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
            pf[kk][0] = as_u32(pack2(s[0][2 * kk][0], s[0][2 * kk][1]));
            pf[kk][1] = as_u32(pack2(s[0][2 * kk][2], s[0][2 * kk][3]));
            pf[kk][2] = as_u32(pack2(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]));
            pf[kk][3] = as_u32(pack2(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]));
        }
        const int ring = done + i;

        mbar_wait(v_full + ring % STAGES, (ring / STAGES) & 1);

        wait_turn(wg);

fence_regs(acc_o[0]);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j) {
                acc_o[mt][j][0] *= alpha[mt][0];
                acc_o[mt][j][1] *= alpha[mt][0];
                acc_o[mt][j][2] *= alpha[mt][1];
                acc_o[mt][j][3] *= alpha[mt][1];
            }
        {
            const elem_t* v_tile = sV + (ring % STAGES) * TILE_ELEMS(BLOCK_N);
            fence_regs(acc_o[0]);
            wgmma_fence();
            const uint64_t v0 = sw128_desc(v_tile, BLOCK_N * 128);  // then offsets (16 bytes)
            #pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk)  // keys 16 kk .. 16 kk + 15: two groups of 8 rows
                wgmma_pv(acc_o[0], pf[kk], sw128_desc_plus(v0, kk * 16 * 64 * sizeof(elem_t) / 16));
            wgmma_commit();
        }
        pass_turn(wg);

        wgmma_wait<0>();
        fence_regs(acc_o[0]);
        if (lane == 0) mbar_arrive(v_empty + ring % STAGES);
        done += n_blocks;
        ++q_uses;
    }
    {  // The output through this warpgroup's rows of the Q buffer (its S have all completed; a tile with no
       // key block writes its zeros the same way), stored by TMA while the warpgroup goes on to its next tile.
        elem_t* staged = sQ + q_slot * TILE_ELEMS(BLOCK_M);
float* lse_base = lse == nullptr ? nullptr : lse + b * l_sb + r * l_sr + h * l_sh;
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        #pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float sum = row_sum[mt][rr];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            const int tile_row = warp_row0 + mt * 16 + g + rr * 8, row = q0 + tile_row;
            if (lse_base != nullptr && t == 0 && row < seq_q)
                lse_base[(long long)row * l_ss] =
                    sum > 0.f ? (row_max[mt][rr] * scale_log2 + log2f(sum)) * 0.69314718f : -INFINITY;

            // 16-byte chunk c of a box row sits at chunk c ^ (row % 8), and row % 8 is g: a warp's 4-byte
            // writes hit 32 banks. 32-bit shared addresses keep the registers of 64-bit pointers free.
            const uint32_t staged_row = smem_addr(staged + tile_row * 64) + 4 * t;
            #pragma unroll
            for (int j = 0; j < HEAD_DIM / 8; ++j)
                asm volatile("st.shared.b32 [%0], %1;\n"
                             :: "r"(staged_row + (j / 8) * BLOCK_M * 128 + (((j % 8) ^ g) * 16)),
                                "r"(as_u32(pack2(acc_o[mt][j][2 * rr] * inv, acc_o[mt][j][2 * rr + 1] * inv))));

        }
        fence_async_proxy();  // the generic-proxy writes become visible to the TMA engine
        asm volatile("bar.sync %0, 128;\n" :: "r"(4 + wg) : "memory");  // this warpgroup's rows are all written
        if (STORER) {
            #pragma unroll
            for (int cb = 0; cb < HEAD_DIM / 64; ++cb)
                tma_store_head(&o_map, staged + cb * BLOCK_M * 64 + wg * 64 * 64, cb * 64, q0 + wg * 64, r, h, b);
            bulk_commit();
        }

        staged_q = q_slot;

    }
    }


        if (staged_q >= 0) {
            if (STORER) {
                bulk_wait_read<0>();
                mbar_arrive_count(q_empty + staged_q, 4);
            }
            staged_q = -1;
        }


    // Every turn was handed on, the last one to warpgroup 0: it takes it, leaving no arrival pending.
    if (q_uses > 0 && wg == 0) wait_turn(wg);
}
