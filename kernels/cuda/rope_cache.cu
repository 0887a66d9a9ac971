// rope_and_cache as ONE CUDA kernel, compiled at lowering time by NVRTC (jax_rope_cache/compilers/nvrtc.py).
//
// Static configuration (one compiled variant per call-site shape, all required, set with -D by
// jax_rope_cache/backends/cuda.py: kernel_config):
//   RC_QH, RC_KH, RC_D, RC_R     query heads, kv heads, head_dim, rotary_dim
//   RC_BS                        cache block size
//   RC_LAYOUT                    RcLayout (0 flash, 1 xpacked, 2 xpacked_shuffled, 3 hnd, 4 head_major,
//                                5 kv_merged: K and V in the key cache [.., NB, BS, 2 KH, D], K head h
//                                at 2h and V head h at 2h + 1; the value_cache pointers are a placeholder
//                                nothing reads or writes)
//   RC_NB                        0 (default): NB is the caches' leading dim at run time; > 0 (head_major,
//                                whose caches lead with KH): the blocks per layer, compiled in
//   RC_X                         0 (default): X = 16 bytes of cache elements; else X of the x-packed
//                                layouts (the key cache's last dim): a power of two dividing D (and BS,
//                                shuffled). A chunk wider than X is stored as one access per X group;
//                                V runs are stored whole only where X elements are at most 16 bytes,
//                                and the vector V units (RC_VCH, RC_VSEL) need the default X
//   RC_NEOX, RC_FULL_TABLE       1/0
//   RC_NATIVE                    1: "native" precision (rc_arith picks "rounded" or "fused" arithmetic
//                                from RC_DT and RC_TAB_DT), 0: "fp32"
//   RC_DT, RC_TAB_DT, RC_CACHE_DT  RcDtype codes of q/k/v (and outputs), cos/sin, the caches
//   RC_SLOT64, RC_POS64          1: int64 slot_mapping / positions, 0: int32
//   RC_LAYER_BLOCKS              0: one cache [NB, ...]; NB > 0: stacked caches [L, NB, ...], the
//                                layer to write read from the `layer` operand (a device scalar)
//   RC_WCH                       elements per chunk: 16 bytes of q/k/v where the shape allows
//                                (power of two; divides D and R, and R/2 for NeoX; even for GPT-J)
//   RC_TPB                       tokens per thread block (a power of two)
//   RC_NT                        threads per block (launch bound)
//   RC_MINB                      blocks per multiprocessor the register budget must allow
//                                (__launch_bounds__ second argument)
//   RC_VPAIRS                    1 (default): x-packed V lanes paired so a warp store fills whole
//                                sectors of a slot run (see v_unit_xpacked)
//   RC_VCH                       1 (default): channels per x-packed V unit (v_unit_xpacked); 2, 4 or 8
//                                (C * element size <= 16 bytes, D % C == 0): v_unit_xpacked_vec
//   RC_VSEL                      0 (default): off; C in {2, 4, 8} (x-packed, RC_VCH 1, VG == X, BS % X
//                                == 0, C * element size <= 16, D % C == 0): V units chosen per BLOCK
//                                at run time: a block whose groups are all aligned runs takes
//                                C-channel run units (v_unit_run), any other block the one-channel units
//                                (v_unit_xpacked); see block_runs
//   RC_Q_NORM, RC_K_NORM         -1 (default): no RMSNorm; else the RcDtype of q_norm_weight /
//                                k_norm_weight (q's dtype or f32): Qwen3's per-head QK-norm before
//                                the rotation (block "QK-RMSNorm")
//   RC_NORM_EPS_BITS             the norm's eps as float32 bits (hex)
//   RC_KS_HEADS, RC_VS_HEADS     1: k_scale / v_scale are [KH] (kv head h uses scale[h]); 0: one scale
//   RC_KPAIRS                    0 (default): rotation units in the order below; 1 (x-packed layouts,
//                                RC_TPB even; otherwise the same as 0): the k heads' units paired by
//                                token, so a warp's key cache stores fill whole sectors (rot_idx)
//   RC_SPLIT                     1 (default): a block does all its units; S > 1: the block's units
//                                are split over S blocks (grid.y = S, part blockIdx.y takes units
//                                y * NT + tid, + NT * S, ...), so a small call whose token has more
//                                units than a block's threads spreads over S SMs, one unit a thread
//   RC_EARLY_W                   1 (default): with a norm whose weight has q's dtype, a rotation unit
//                                loads its weight chunk(s) with its q/k chunks (no load after the
//                                sum); 0: after the sum (fewer live registers)
//   RC_MROPE                     0 (default): positions [T]; 1 (sections) / 2 (interleaved): multimodal
//                                RoPE, positions [3, T] (temporal, height, width at s * T + t)
//   RC_MROPE_T, _H, _W           the sections: rotary frequency i takes its table values from the row
//                                of stream rc_mrope_stream(i, RC_MROPE, T, H, W) (rope_cache_math.h);
//                                each stream's position is clamped on its own
//   RC_MROW                      0 (default): an M-RoPE rotation unit takes its columns from the
//                                three streams' rows itself (load_tab3); 1 (M-RoPE only): the block
//                                merges each of its tokens' cos/sin rows once into shared memory
//                                ("merged rows" below) and rotation units read them as a 1-D row
//   RC_QKV                       0 (default): q [T, QH, D], k and v [T, KH, D]; 1: the q, k and v operands
//                                are each the fused QKV tensor [T, QH + 2 KH, D] (rope_and_cache_qkv):
//                                q head h of token t at row t, head h; k head h at head QH + h; v head h
//                                at head QH + KH + h (in_row_of, v_row_of); outputs as with 0
//   RC_TOKEN_SCALES              0 (default): static scales; 1 (fp8 or int8 caches, RC_CACHE_DT 6:
//                                int8, always per token): per-token scales: the
//                                k_scale / v_scale operands are the scale caches [.., NB, KH, BS] f32,
//                                two more results (k_sc, v_sc: the same buffers) receive one scale per
//                                (token, kv head) at the token's slot (block "per-token scales"); V
//                                units are row units (token, kv head, chunk) in every layout
//                                RC_CACHE_DT 8 / 9 (NVFP4 / MXFP4, rope_cache_math.h's RcBlockDtype):
//                                uint8 caches of E2M1 pairs, the scale caches the block-scale caches
//                                (one byte per 16 / 32 channels); NVFP4's global decode scales k_g, v_g
//                                (f32 []) are the last operands; block units replace the V units
//                                (block "block formats"); flash, hnd and head_major only
//   Model-family options (block "model families"; each macro absent by default, the kernel then
//   the same code as without them):
//   RC_ROT_OFF                   0: rotary channels [0, R); D - R (rotary_position="tail"): the
//                                rotary channels are [D - R, D), channels [0, D - R) pass through
//                                (RC_R = 0, NoPE: no rotation units, every chunk passes through)
//   RC_USE_ROPE                  1: the use_rope operand (int32 [], after the 14 operands) switches
//                                the rotation per call (0: no rotation, no norm "after", temperature)
//   RC_TEMP_FS                   floor_scale of the attention temperature: the temperature_factors
//                                operand (f32 [max_pos / FS + 1], after use_rope) scales q on calls
//                                that do not rotate: q_out = r(r32(q * f[(clamp(p) + 1) / FS]))
//   RC_NORM_TYPE                 0 rms (r(w * r(x * inv))), 1 gemma (r(r32(x * inv) * r32(1 + w))),
//                                2 weightless (r(x * inv) on q and k; RC_Q_NORM = RC_K_NORM = RC_DT, the
//                                weights are placeholders never read)
//   RC_NORM_AFTER                1: the QK-norm runs on the rotated, rounded q and k rows (on calls
//                                that rotate; none on calls that do not)
//   RC_QGATE                     1 (with RC_QKV): the fused rows hold 2 QH q heads, q head h at 2h
//                                (its gate at 2h + 1, never read), then the k and v heads
// Without the norm and per-head scales (all at their defaults) the kernel is the same code as
// before them (every norm / per-head-scale path is behind `if constexpr`).
//
// Kernel ABI (what kernels/ffi/gpu_launcher.cc passes; the launcher is generic and knows nothing of
// this op): one kernel parameter, a struct by value holding
//   void*  ptr[18]   device pointers of the 14 operands, then of the 4 results, in custom-call order:
//                    q, k, v, key_cache, value_cache, slot_mapping, positions, cos, sin, k_scale,
//                    v_scale (f32 [] or [KH]), layer (int32), q_norm_weight, k_norm_weight ([D], or
//                    an f32[1] placeholder when absent) | q_out, k_out, key_cache_out, value_cache_out
//                    (RC_TOKEN_SCALES: ptr[20], k_scale / v_scale the scale caches, then the results
//                    k_scale_cache_out, v_scale_cache_out after value_cache_out)
//   int64  dim0[14]  the leading dimension of each operand (rank-0 operands: 1)
// Grid: (ceil(T / RC_TPB), RC_SPLIT, 1) blocks of RC_NT threads, T = dim0[0]; static shared memory
// only with RC_MROW (no dynamic shared memory).
// Runtime values: T = dim0[0], NB = dim0[3] (stacked: L = dim0[3]; head_major: NB = RC_NB), max_pos = dim0[7]; every index
// (slots, positions, layer) comes from device buffers, so a captured CUDA graph replays correctly
// whatever the slots and positions hold.
//
// Work decomposition: no shared memory and no barrier (RC_MROW: one, see "merged rows"). A block owns
// RC_TPB consecutive tokens and a list of independent units, each done by one thread from its first
// load to its last store
// (threads take units tid, tid + NT, ...; the configuration makes NT >= the unit count where it
// can, so most threads do exactly one):
//   * rot units   (token, q/k head, pair-chunk j), j fastest: NeoX loads chunk j and chunk j + R/2,
//                 GPT-J one chunk of whole pairs; k heads also go to the key cache. The thread
//                 issues its q/k loads, its slot and its position first; the cos/sin values of its
//                 chunk are the one dependent load (row = position). Heads of one token share the
//                 table values through L1 (lanes of one warp read the same addresses).
//                 RC_KPAIRS (x-packed, TPB even): the block's q-head units first, (token, q head, j),
//                 then its k-head units as (token pair, k head, j, token parity), parity fastest:
//                 lanes 2m and 2m+1 are tokens 2t and 2t+1 of one (k head, chunk), whose 16-byte
//                 key pieces are neighbours (slots off, off+1 of a prefill run): one 32-byte sector
//                 per lane pair instead of half-sectors 256 B apart.
//   * pass units  (token, q/k head, chunk >= R): copy channels >= R to q_out/k_out (and K cache).
//   With a norm, a rot unit normalises its chunk(s) before rotating them. R == D, D a power of
//   two and P <= 32 units per head (NORM_LANES: Qwen3): the P units of one (token, head) are P
//   consecutive, P-aligned lanes of one warp (U_ROT is a multiple of P, NT of 32; RC_KPAIRS k heads:
//   every other lane of 2P aligned lanes, shuffles xor 2..P, 2P <= 32); each lane sums
//   the squares of its chunk(s) by the spec's tree, an xor butterfly (shuffles 1..P/2, per-head
//   mask) completes the tree in every lane with the same bits (NeoX: the halves [0, D/2) and
//   [D/2, D) separately, added last). Otherwise (R < D, D not a power of two, P > 32) every rot
//   and pass unit sums its whole row itself (the other chunks are L1 hits): slower, same bits.
//   * V units     flash: (token, kv head, chunk): one 16-byte copy into the value cache.
//                 x-packed: (group of VG tokens, kv head, channel d), d fastest: the thread loads
//                 channel d of its VG tokens. When the group's slots are one aligned run (VG = X
//                 consecutive slots starting at a multiple of X: prefill), it writes them as ONE
//                 16-byte store (a whole X-offset piece of a value row, whole 32-byte sectors
//                 with its neighbour); otherwise one element per token, and the lanes of a warp
//                 (consecutive d of one token) write neighbouring sectors of one block (random
//                 slots: the fewest L2 requests for that pattern). RC_VCH = C > 1: channels
//                 d..d+C-1, each token's C channels one load, the group's slots in 16-byte loads;
//                 a run is transposed in registers (prmt) into C pieces, other groups go element
//                 by element as above (fewer instructions per stored byte, more registers).
//                 RC_VSEL = C (RC_VCH 1): every thread first decides from the block's slots whether
//                 ALL its groups are aligned runs (block_runs); such a block's V units are C-channel
//                 run units (v_unit_run: C pieces, no per-group check, N_V_RUN of them), any other
//                 block's are the one-channel units above, unchanged (random slots keep their lane
//                 order). The unit loop's bound is the block's count (the same in all its threads).
//
// Bounds: positions are clamped to [0, max_pos-1]; a slot writes only if 0 <= slot < NB*BS (and,
// stacked, 0 <= layer < L); all offsets are 64-bit. RC_TOKEN_SCALES: the same slot indexes the scale
// caches, and the launcher's entry takes NB (L) as the least leading dimension of the caches and both
// scale caches. q_out/k_out are written for every token.
// Arithmetic: kernels/common/rope_cache_math.h (rc_mul/rc_add/rc_sub/rc_fma are the _rn intrinsics,
// and NVRTC runs with --fmad=false, so the only FMA is rc_fma of "fused" native arithmetic),
// bit-exact to jax_rope_cache.reference in both precisions; subnormals kept (no --ftz); every NaN
// the kernel computes is the canonical one (rope_cache_math.h), copies keep their bits. On
// sm_80+ the f32 -> bf16/f16 roundings are the cvt.rn instructions (RC_HW_CVT below and the
// block "hardware conversions"): the same bits as the integer code for every non-NaN value
// (checked over all 2^32 inputs on the H200); a NaN becomes the canonical quiet NaN 0x7FFF.
#ifdef RC_EMULATE
#include "host_emulation.h"  // CPU build for tests: one thread per block (RC_NT=1)
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define RC_HW_CVT 1  // rope_cache_math.h: rc_f32_to_bf16 / rc_f32_to_f16 by cvt.rn
#endif
#include "rope_cache_math.h"

#ifndef RC_QH
#error "rope_cache.cu needs its -D configuration (see the header comment)"
#endif
#ifndef RC_MINB
#define RC_MINB 1
#endif
#ifndef RC_VPAIRS
#define RC_VPAIRS 1
#endif
#ifndef RC_VCH
#define RC_VCH 1
#endif
#ifndef RC_VSEL
#define RC_VSEL 0
#endif
#ifndef RC_Q_NORM  // QK-norm and per-head scale options; their defaults are the kernel without them
#define RC_Q_NORM (-1)
#endif
#ifndef RC_K_NORM
#define RC_K_NORM (-1)
#endif
#ifndef RC_NORM_EPS_BITS
#define RC_NORM_EPS_BITS 0
#endif
#ifndef RC_KS_HEADS
#define RC_KS_HEADS 0
#endif
#ifndef RC_VS_HEADS
#define RC_VS_HEADS 0
#endif
#ifndef RC_EARLY_W
#define RC_EARLY_W 1
#endif
#ifndef RC_KPAIRS
#define RC_KPAIRS 0
#endif
#ifndef RC_SPLIT
#define RC_SPLIT 1
#endif
#ifndef RC_TOKEN_SCALES  // per-token fp8 scales off: k_scale / v_scale are static scales
#define RC_TOKEN_SCALES 0
#endif
#ifndef RC_X  // the default X: 16 bytes of cache elements
#define RC_X 0
#endif
#ifndef RC_MROPE  // multimodal RoPE off: positions [T]
#define RC_MROPE 0
#define RC_MROPE_T 0
#define RC_MROPE_H 0
#define RC_MROPE_W 0
#endif
#ifndef RC_MROW
#define RC_MROW 0
#endif
#ifndef RC_NB  // NB from the caches' leading dim
#define RC_NB 0
#endif
#ifndef RC_ROT_OFF  // model families (header comment); the defaults are the kernel without them
#define RC_ROT_OFF 0
#endif
#ifndef RC_USE_ROPE
#define RC_USE_ROPE 0
#endif
#ifndef RC_TEMP_FS
#define RC_TEMP_FS 0
#endif
#ifndef RC_NORM_TYPE
#define RC_NORM_TYPE 0
#endif
#ifndef RC_NORM_AFTER
#define RC_NORM_AFTER 0
#endif
#ifndef RC_QGATE
#define RC_QGATE 0
#endif

namespace rc {

// Model families (enums: no new symbols, so a kernel without them keeps its PTX byte for byte).
enum : int {
  ROFF = RC_ROT_OFF,  // the first rotary channel
  USE_ROPE = RC_USE_ROPE != 0,
  TEMP_FS = RC_TEMP_FS,
  NORM_TYPE = RC_NORM_TYPE,
  NORM_AFTER = RC_NORM_AFTER != 0,
  QGATE = RC_QGATE != 0
};

constexpr int QH = RC_QH, KH = RC_KH, D = RC_D, R = RC_R, BS = RC_BS;
constexpr int LAYER_BLOCKS = RC_LAYER_BLOCKS;
constexpr int RH = QH + KH;  // heads rotated per token
constexpr int W = RC_WCH;
constexpr int TPB = RC_TPB, NT = RC_NT, SPLIT = RC_SPLIT;
constexpr bool NEOX = RC_NEOX != 0, FULL = RC_FULL_TABLE != 0, NATIVE = RC_NATIVE != 0;
constexpr int DT = RC_DT, TAB_DT = RC_TAB_DT, CDT = RC_CACHE_DT, LAYOUT = RC_LAYOUT;
constexpr bool FP8 = CDT == RC_FP8_E4M3FN || CDT == RC_FP8_E4M3FNUZ || CDT == RC_FP8_E5M2;
// int8 caches (RC_CACHE_DT = RC_INT8): per-token scales only (RC_TOKEN_SCALES), values in [-127, 127].
// int4 caches (RC_INT4): bytes of two values (channel 2j in the low nibble), rows of D / 2 bytes.
// NVFP4 / MXFP4 caches (RC_NVFP4, RC_MXFP4: BLKF): bytes as int4's, E2M1 codes, one block-scale byte per
// GRP channels of a row (block "block formats"); PK4: the caches of two values a byte.
enum : int {
  INT8C = CDT == RC_INT8,
  INT4C = CDT == RC_INT4,
  NVF = CDT == RC_NVFP4,
  BLKF = NVF || CDT == RC_MXFP4,
  GRP = NVF ? 16 : 32,
  LOWB = INT8C || INT4C || BLKF,
  PK4 = INT4C || BLKF,
  CPB = PK4 ? 2 : 1
};
constexpr int ARITH = rc_arith(NATIVE, DT, TAB_DT);  // RC_ARITH_FP32, "rounded" (DT) or RC_ARITH_FUSED
// An fp8 key cache in "fused" arithmetic quantizes the rotated f32 values, not the rounded k_out.
// The norm after the rotation makes k_out (rounded, normalised) what the cache stores.
constexpr bool WIDE_K = (FP8 || LOWB) && ARITH == RC_ARITH_FUSED && !NORM_AFTER;
constexpr RcDtype FP8_DT = static_cast<RcDtype>(CDT);  // the fp8 format rc_quantize_fp8 writes (FP8 only)
constexpr bool XP = LAYOUT == RC_XPACKED || LAYOUT == RC_XPACKED_SHUFFLED;  // flash and hnd: rows of D
constexpr int S_IN = DT == RC_F32 ? 4 : 2;
constexpr int S_TAB = TAB_DT == RC_F32 ? 4 : 2;
constexpr int S_CACHE = (FP8 || LOWB) ? 1 : S_IN;
constexpr int X = RC_X > 0 ? RC_X : 16 / S_CACHE;  // x-packed group width (elements)
constexpr bool X_FITS = X * S_CACHE <= 16;           // a group of X elements is one access
// Elements per key-cache store of a chunk: the chunk, or one X group of it where X < W.
constexpr int KW = (XP && X < W) ? X : W;
constexpr int HALF = R / 2;
constexpr int TW = FULL ? R : HALF;      // table row width
constexpr int CH = D / W;                // chunks per head row
constexpr int P = NEOX ? HALF / W : R / W;  // rotation units per head
constexpr int CPASS = (D - R) / W;       // pass-through chunks per head
constexpr int PASS0 = ROFF > 0 ? 0 : R / W;  // first pass-through chunk (tail rotary: chunk 0)
// QK-RMSNorm: -1, or the RcDtype of the weight (q's dtype or f32).
constexpr int Q_NORM = RC_Q_NORM, K_NORM = RC_K_NORM;
constexpr bool NORM = Q_NORM >= 0 || K_NORM >= 0;
constexpr bool KS_HEADS = RC_KS_HEADS != 0, VS_HEADS = RC_VS_HEADS != 0;  // scale[kv head]
constexpr int MROPE = RC_MROPE;  // RcMrope: positions [3, T], one stream per rotary frequency
enum : bool { MROW = MROPE != 0 && RC_MROW != 0 };  // M-RoPE rows merged per block (an enum: no symbol)
// head_major: the blocks per layer (its caches lead with KH); kv_merged: V rows in the key cache.
enum : int { NBL = RC_NB, NBL_DIV = RC_NB > 0 ? RC_NB : 1, MERGED = LAYOUT == RC_KV_MERGED };
constexpr bool is_pow2(int n) { return n > 0 && (n & (n - 1)) == 0; }
// The P lanes of a head's rotation units hold whole subtrees of the sum-of-squares tree (R == D,
// D a power of two; NeoX: chunks j and j + P are subtrees of the two halves of the row): each
// lane reduces its chunk(s), an xor butterfly over the P lanes finishes the tree. Otherwise
// every unit computes the whole tree from the row itself (norm_generic).
constexpr bool NORM_LANES = NORM && R == D && is_pow2(D) && P <= 32;
// Weights of q's dtype (the usual case): a rotation unit can hold its weight chunks as Chunks.
constexpr bool EARLY_W = RC_EARLY_W != 0 && NORM && NORM_TYPE != RC_NORM_WEIGHTLESS && (Q_NORM < 0 || Q_NORM == DT) &&
                        (K_NORM < 0 || K_NORM == DT);

// Units of one block, in this order: rotation, pass-through, V.
constexpr int U_ROT = RH * P;                            // per token
constexpr int U_PASS = RH * CPASS;                       // per token
constexpr int VGX = X_FITS ? X : 16 / S_CACHE;           // tokens per x-packed V unit, if TPB allows
constexpr int VG = !XP ? 1 : (TPB % VGX == 0 ? VGX : TPB);  // tokens per x-packed V unit
constexpr bool V_RUNS = XP && VG == X && BS % X == 0;    // aligned runs can be stored whole
constexpr int VCH = RC_VCH;                              // channels per x-packed V unit
constexpr int DC = D / VCH;                              // channel groups per kv head
constexpr int N_ROT = TPB * U_ROT;
enum : int { P_DIV = P > 0 ? P : 1, UROT_DIV = U_ROT > 0 ? U_ROT : 1 };  // RC_R = 0 (NoPE): no rotation units
// RC_KPAIRS: k-head units paired by token (rot_idx). With the K norm's lane butterfly, a head's P
// units sit on every other lane of 2P aligned lanes (shuffles xor 2..P): needs 2P <= 32, else unpaired.
// (An enum, not constexpr variables: no new symbols, so RC_KPAIRS=0 gives today's PTX byte for byte.)
// RC_TOKEN_SCALES: TOKEN; TOKEN_LANES: a k row's amax over its P rotation lanes by shuffles (the
// QK-norm's lane structure: R == D, D a power of two, P <= 32), else every unit reads the whole row.
enum : int {
  TOKEN = RC_TOKEN_SCALES != 0,
  TOKEN_LANES = TOKEN && !BLKF && R == D && is_pow2(D) && P <= 32,
  KPAIRS = RC_KPAIRS != 0 && XP && TPB % 2 == 0 && (!((NORM_LANES && K_NORM >= 0) || TOKEN_LANES) || 2 * P <= 32),
  N_QROT = TPB * QH * P  // KPAIRS: the q-head units, first
};
constexpr int N_PASS = TPB * U_PASS;
// BLKF: block units (token, k or v, kv head, block of GRP channels) instead of V units (block_unit).
constexpr int N_V = BLKF ? TPB * 2 * KH * (D / GRP) : XP && !TOKEN ? (TPB / VG) * KH * DC : TPB * KH * CH;
// RC_TOKEN_SCALES: where CH is a power of two <= 32, the V units start at V0, the next multiple of CH
// (the units between are idle), so a v row's CH units are CH aligned lanes of one warp: their amax
// by xor shuffles (V_LANES); otherwise each unit reads its row.
enum : int {
  V_LANES = TOKEN && !BLKF && is_pow2(CH) && CH <= 32,
  V0 = V_LANES ? (N_ROT + N_PASS + CH - 1) / CH * CH : N_ROT + N_PASS  // the first V unit
};
constexpr int N_UNITS = V0 + N_V;
// RC_VSEL = C: a block whose TPB tokens are all < T and whose every group of X tokens is an aligned
// run (block_runs) has N_V_RUN V units of C channels instead of the N_V above (the threads, NT, are
// sized by N_UNITS: such a block leaves some idle).
constexpr int VSEL = RC_VSEL;
constexpr int N_V_RUN = VSEL > 0 ? (TPB / X) * KH * (D / VSEL) : N_V;

static_assert(W >= 1 && (W & (W - 1)) == 0 && W * S_IN <= 16, "RC_WCH: power of two, at most 16 bytes");
static_assert(D % W == 0 && R % W == 0 && R % 2 == 0 && R <= D, "RC_WCH must divide D and R");
static_assert(ROFF == 0 || (R > 0 && ROFF == D - R), "RC_ROT_OFF: 0 or D - R (tail rotary)");
static_assert(TEMP_FS == 0 || MROPE == 0, "RC_TEMP_FS: positions [T]");
static_assert(NORM_TYPE >= 0 && NORM_TYPE <= 2 && (NORM_TYPE != RC_NORM_WEIGHTLESS || (Q_NORM == DT && K_NORM == DT)),
              "RC_NORM_TYPE: 0, 1 or 2 (weightless: RC_Q_NORM = RC_K_NORM = RC_DT)");
static_assert(!NORM_AFTER || (NORM && R > 0), "RC_NORM_AFTER: a norm and a rotation");
static_assert(!NEOX || HALF % W == 0, "NeoX: RC_WCH must divide R/2");
static_assert(NEOX || W % 2 == 0, "GPT-J: RC_WCH must be even");
static_assert(X >= 1 && (X & (X - 1)) == 0, "RC_X: a power of two");
static_assert(X % KW == 0 && W % KW == 0, "a key-cache store stays inside one x-packed group");
static_assert(LAYOUT >= RC_FLASH && LAYOUT <= RC_KV_MERGED, "RC_LAYOUT");
static_assert((LAYOUT == RC_HEAD_MAJOR) == (NBL > 0) && (RC_LAYER_BLOCKS == 0 || NBL == 0 || RC_LAYER_BLOCKS == NBL),
              "RC_NB: head_major's blocks per layer (the stacked caches' RC_LAYER_BLOCKS), 0 otherwise");
static_assert(!XP || (D % X == 0), "x-packed layouts need D % X == 0");
static_assert(!XP || !INT4C || ((D / 2) % X == 0), "x-packed int4 caches need (D / 2) % X == 0");
static_assert(LAYOUT != RC_XPACKED_SHUFFLED || BS % X == 0, "xpacked_shuffled needs BS % X == 0");
static_assert(DT == RC_F32 || DT == RC_BF16 || DT == RC_F16, "RC_DT");
static_assert(FP8 || LOWB || CDT == DT, "cache dtype: q's dtype, fp8, int8 or int4");
static_assert(!INT4C || (W % 2 == 0 && RC_X == 0), "int4 caches: chunks of whole bytes, the default X");
static_assert(TPB >= 1 && (TPB & (TPB - 1)) == 0, "RC_TPB: a power of two");
static_assert(SPLIT >= 1 && SPLIT <= 64, "RC_SPLIT: 1 .. 64 parts");
static_assert(RC_F16 == 2, "RC_PACKED_NATIVE's #if spells RC_F16 as 2");
static_assert(Q_NORM == -1 || Q_NORM == RC_F32 || Q_NORM == DT, "RC_Q_NORM: -1, f32 or q's dtype");
static_assert(K_NORM == -1 || K_NORM == RC_F32 || K_NORM == DT, "RC_K_NORM: -1, f32 or q's dtype");
static_assert(!NORM_LANES || (is_pow2(P) && 32 % P == 0 && U_ROT % P == 0 && CH == (NEOX ? 2 : 1) * P),
              "a head's rotation units: P aligned lanes of one warp covering the row");
static_assert(!(KS_HEADS || VS_HEADS) || FP8, "per-head scales: fp8 caches only");
static_assert(!LOWB || TOKEN, "int8 / int4 caches: per-token scales (RC_TOKEN_SCALES)");
static_assert(!BLKF || ((LAYOUT == RC_FLASH || LAYOUT == RC_HND || LAYOUT == RC_HEAD_MAJOR) && D % GRP == 0 &&
                        GRP % W == 0 && W % 2 == 0),
              "NVFP4 / MXFP4 caches: flash, hnd or head_major, D a multiple of the block group");
static_assert(!TOKEN || ((FP8 || LOWB) && !KS_HEADS && !VS_HEADS && VCH == 1 && VSEL == 0),
              "RC_TOKEN_SCALES: fp8 caches, no static per-head scales, one-channel V units");
static_assert(VCH == 1 || X * S_CACHE == 16, "RC_VCH > 1: 16-byte x-packed groups (the default X)");
static_assert(VSEL == 0 || X * S_CACHE == 16, "RC_VSEL: 16-byte x-packed groups (the default X)");
static_assert(VCH == 1 || (XP && (VCH == 2 || VCH == 4 || VCH == 8) && VCH * S_IN <= 16 && D % VCH == 0),
              "RC_VCH: 1, or 2/4/8 channels of at most 16 bytes dividing D (x-packed layouts)");
static_assert(VSEL == 0 || (V_RUNS && VCH == 1 && (VSEL == 2 || VSEL == 4 || VSEL == 8) && VSEL * S_IN <= 16 &&
                            D % VSEL == 0),
              "RC_VSEL: 0, or 2/4/8 channels of at most 16 bytes dividing D (x-packed runs, RC_VCH 1)");
#ifndef RC_EMULATE
static_assert(NT % 32 == 0 && NT >= 32 && NT <= 1024, "RC_NT");
#endif

typedef long long i64;

// ---- raw element types and vectors -----------------------------------------------------------
template <int BYTES> struct VecOf;
template <> struct VecOf<16> { typedef uint4 T; };
template <> struct VecOf<8> { typedef uint2 T; };
template <> struct VecOf<4> { typedef unsigned int T; };
template <> struct VecOf<2> { typedef unsigned short T; };
template <> struct VecOf<1> { typedef unsigned char T; };

template <int S> struct RawOf;
template <> struct RawOf<4> { typedef unsigned int T; };
template <> struct RawOf<2> { typedef unsigned short T; };
template <> struct RawOf<1> { typedef unsigned char T; };

typedef RawOf<S_IN>::T raw_in;
typedef RawOf<S_CACHE>::T raw_cache;
typedef RawOf<S_TAB>::T raw_tab;

// W input elements moved as one access.
union Chunk {
  VecOf<W * S_IN>::T v;
  raw_in e[W];
  unsigned int w[(W * S_IN) / 4 > 0 ? (W * S_IN) / 4 : 1];
};
// W cache elements moved as one access (same bytes as Chunk unless the cache is fp8).
union CacheChunk {
  VecOf<W * S_CACHE / CPB>::T v;
  raw_cache e[W / CPB];
};
// X cache elements: one piece (16 bytes at the default X) of an x-packed row (V_RUNS: X_FITS).
union CachePiece {
  VecOf<X_FITS ? X * S_CACHE : 16>::T v;
  raw_cache e[X_FITS ? X : 16 / S_CACHE];
};
// KW cache elements: one key-cache store of a chunk split by X groups (KW < W).
union KeyPiece {
  VecOf<KW * S_CACHE>::T v;
  raw_cache e[KW];
};

template <int dt>
__device__ __forceinline__ float to_f32(unsigned int raw) {
  if (dt == RC_BF16) return rc_bf16_to_f32((rc_u16)raw);
  if (dt == RC_F16) return rc_f16_to_f32((rc_u16)raw);
  return __uint_as_float(raw);
}

__device__ __forceinline__ raw_in from_f32(float f) {
  if (DT == RC_BF16) return (raw_in)rc_f32_to_bf16(f);
  if (DT == RC_F16) return (raw_in)rc_f32_to_f16(f);
  return (raw_in)__float_as_uint(rc_canonical_f32(f));
}

// ---- hardware conversions (CUDA sm_80+; the host emulation and older archs use the integer code) --
// Two outputs rounded to the input dtype by ONE packed instruction (cvt.rn.{bf16x2,f16x2}.f32,
// low half = `lo`). Bit-identical to from_f32 for every non-NaN value; NaN -> 0x7FFF (canonical).
__device__ __forceinline__ unsigned int pack_out2(float lo, float hi) {
#ifdef RC_HW_CVT
  unsigned int r;
  if constexpr (DT == RC_BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
#else
  return (unsigned int)from_f32(lo) | ((unsigned int)from_f32(hi) << 16);
#endif
}
// ---- end of hardware conversions ------------------------------------------------------------

// Chunk of W outputs from W f32 values (rounded once to the input dtype).
__device__ __forceinline__ Chunk chunk_from(const float* y) {
  Chunk c;
  if constexpr (S_IN == 2 && W % 2 == 0) {
#pragma unroll
    for (int e = 0; e < W; e += 2) c.w[e / 2] = pack_out2(y[e], y[e + 1]);
  } else {
#pragma unroll
    for (int e = 0; e < W; ++e) c.e[e] = from_f32(y[e]);
  }
  return c;
}

__device__ __forceinline__ Chunk load_chunk(const void* base, i64 elem) {
  Chunk c;
  c.v = *reinterpret_cast<const VecOf<W * S_IN>::T*>(static_cast<const char*>(base) + elem * S_IN);
  return c;
}

// The same loads, issued where they are written: the compiler may not sink them into the branch
// that uses them (it would, behind the slot check, making the slot and the data two round trips).
template <class V>
__device__ __forceinline__ V load_now(const void* addr) {
#ifdef __CUDA_ARCH__
  V r;
  if constexpr (sizeof(V) == 16) {
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(addr));
  } else if constexpr (sizeof(V) == 8) {
    asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(addr));
  } else if constexpr (sizeof(V) == 4) {
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(r) : "l"(addr));
  } else if constexpr (sizeof(V) == 2) {
    asm volatile("ld.global.u16 %0, [%1];" : "=h"(r) : "l"(addr));
  } else {
    unsigned short h;
    asm volatile("ld.global.u8 %0, [%1];" : "=h"(h) : "l"(addr));
    r = (V)h;
  }
  return r;
#else
  return *static_cast<const V*>(addr);
#endif
}

__device__ __forceinline__ Chunk load_chunk_now(const void* base, i64 elem) {
  Chunk c;
  c.v = load_now<VecOf<W * S_IN>::T>(static_cast<const char*>(base) + elem * S_IN);
  return c;
}

__device__ __forceinline__ void store_chunk(void* base, i64 elem, const Chunk& c) {
  *reinterpret_cast<VecOf<W * S_IN>::T*>(static_cast<char*>(base) + elem * S_IN) = c.v;
}

__device__ __forceinline__ raw_cache to_cache(raw_in x, float inv_scale) {
  if constexpr (PK4) return (raw_cache)0;  // never called: int4 stores pack pairs (int4_chunk)
  if constexpr (INT8C) return (raw_cache)(rc_u8)rc_quantize_int(to_f32<DT>(x), inv_scale, 127.0f);
  if (FP8) return (raw_cache)rc_quantize_fp8(to_f32<DT>(x), inv_scale, FP8_DT);
  return (raw_cache)x;
}

// int4: W f32 values as W / 2 bytes (pairs 2j, 2j + 1 of the chunk; chunks start at even channels).
__device__ __forceinline__ CacheChunk int4_chunk(const float* y, float inv_scale) {
  CacheChunk o;
#pragma unroll
  for (int e = 0; e < W / CPB; ++e)
    o.e[e] = (raw_cache)rc_pack_int4(rc_quantize_int(y[2 * e], inv_scale, 7.0f),
                                     rc_quantize_int(y[2 * e + 1], inv_scale, 7.0f));
  return o;
}
__device__ __forceinline__ CacheChunk int4_chunk(const Chunk& c, float inv_scale) {
  float y[W];
#pragma unroll
  for (int e = 0; e < W; ++e) y[e] = to_f32<DT>(c.e[e]);
  return int4_chunk(y, inv_scale);
}

__device__ __forceinline__ void store_cache_chunk(void* base, i64 elem, const Chunk& c, float inv_scale) {
  if constexpr (PK4) {
    *reinterpret_cast<VecOf<W * S_CACHE / CPB>::T*>(static_cast<char*>(base) + elem) = int4_chunk(c, inv_scale).v;
    return;
  }
  CacheChunk o;
#pragma unroll
  for (int e = 0; e < W; ++e) o.e[e] = to_cache(c.e[e], inv_scale);
  *reinterpret_cast<decltype(o.v)*>(static_cast<char*>(base) + elem * S_CACHE) = o.v;
}

// W f32 values quantized into an fp8 cache as one access (WIDE_K only).
__device__ __forceinline__ void store_cache_chunk_f32(void* base, i64 elem, const float* x, float inv_scale) {
  if constexpr (PK4) {
    *reinterpret_cast<VecOf<W * S_CACHE / CPB>::T*>(static_cast<char*>(base) + elem) = int4_chunk(x, inv_scale).v;
    return;
  }
  CacheChunk o;
#pragma unroll
  for (int e = 0; e < W; ++e) {
    if constexpr (INT8C) o.e[e] = (raw_cache)(rc_u8)rc_quantize_int(x[e], inv_scale, 127.0f);
    else o.e[e] = (raw_cache)rc_quantize_fp8(x[e], inv_scale, FP8_DT);
  }
  *reinterpret_cast<decltype(o.v)*>(static_cast<char*>(base) + elem * S_CACHE) = o.v;
}

// *addr = v if `pred`, as one predicated store (no branch: the loads feeding it stay ahead of the
// slot check instead of being moved behind it).
template <class V>
__device__ __forceinline__ void store_if(bool pred, void* addr, V v) {
#ifdef __CUDA_ARCH__
  const int on = pred;
  if constexpr (sizeof(V) == 16) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, %0, 0;\n\t@p st.global.v4.u32 [%1], {%2, %3, %4, %5};\n\t}"
                 :: "r"(on), "l"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
  } else if constexpr (sizeof(V) == 8) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, %0, 0;\n\t@p st.global.v2.u32 [%1], {%2, %3};\n\t}"
                 :: "r"(on), "l"(addr), "r"(v.x), "r"(v.y) : "memory");
  } else if constexpr (sizeof(V) == 4) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, %0, 0;\n\t@p st.global.u32 [%1], %2;\n\t}"
                 :: "r"(on), "l"(addr), "r"(v) : "memory");
  } else if constexpr (sizeof(V) == 2) {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, %0, 0;\n\t@p st.global.u16 [%1], %2;\n\t}"
                 :: "r"(on), "l"(addr), "h"(v) : "memory");
  } else {
    asm volatile("{\n\t.reg .pred p;\n\tsetp.ne.s32 p, %0, 0;\n\t@p st.global.u8 [%1], %2;\n\t}"
                 :: "r"(on), "l"(addr), "h"((unsigned short)v) : "memory");
  }
#else
  if (pred) *static_cast<V*>(addr) = v;
#endif
}

__device__ __forceinline__ void store_cache_chunk_if(bool pred, void* base, i64 elem, const Chunk& c, float inv_scale) {
  if constexpr (PK4) {
    store_if(pred, static_cast<char*>(base) + elem, int4_chunk(c, inv_scale).v);
    return;
  }
  CacheChunk o;
#pragma unroll
  for (int e = 0; e < W; ++e) o.e[e] = to_cache(c.e[e], inv_scale);
  store_if(pred, static_cast<char*>(base) + elem * S_CACHE, o.v);
}

// Key cache stores of chunk c (channels d0 .. d0 + W - 1) at element offset key_index(.., d0 + m * KW)
// of piece m: one store (KW == W), or one per X group of the chunk (x-packed, X < W).
// (Only used where KW < W; the default X keeps the one-store code at the call sites.)
template <class KeyIndex>
__device__ __forceinline__ void store_key_chunk(void* base, const KeyIndex& at, const Chunk& c, float inv_scale,
                                                bool pred = true) {
  {
#pragma unroll
    for (int m = 0; m < W / KW; ++m) {
      KeyPiece o;
#pragma unroll
      for (int e = 0; e < KW; ++e) o.e[e] = to_cache(c.e[m * KW + e], inv_scale);
      store_if(pred, static_cast<char*>(base) + at(m * KW) * S_CACHE, o.v);
    }
  }
}

// The same for W f32 values quantized into an fp8 cache (WIDE_K).
template <class KeyIndex>
__device__ __forceinline__ void store_key_chunk_f32(void* base, const KeyIndex& at, const float* x, float inv_scale) {
  {
#pragma unroll
    for (int m = 0; m < W / KW; ++m) {
      KeyPiece o;
#pragma unroll
      for (int e = 0; e < KW; ++e) {
        if constexpr (INT8C) o.e[e] = (raw_cache)(rc_u8)rc_quantize_int(x[m * KW + e], inv_scale, 127.0f);
        else o.e[e] = (raw_cache)rc_quantize_fp8(x[m * KW + e], inv_scale, FP8_DT);
      }
      *reinterpret_cast<VecOf<KW * S_CACHE>::T*>(static_cast<char*>(base) + at(m * KW) * S_CACHE) = o.v;
    }
  }
}

__device__ __forceinline__ raw_in load_elem_now(const void* base, i64 elem) {
  return load_now<raw_in>(static_cast<const raw_in*>(base) + elem);
}

__device__ __forceinline__ i64 load_index(const void* base, i64 i, bool is64) {
  return is64 ? static_cast<const i64*>(base)[i] : (i64) static_cast<const int*>(base)[i];
}

// head_major [.., KH, NB, BS, D]: block blk of a stacked cache (layer * NB + block) in its layer.
__device__ __forceinline__ i64 head_major_index(i64 blk, i64 off, int h, int d) {
  const i64 layer = blk / NBL_DIV;
  return (((layer * KH + h) * NBL_DIV + (blk - layer * NBL_DIV)) * BS + off) * D + d;
}

// int4 caches: the byte offsets of key_index / value_index in rows of DR = D / 2 bytes, e = d / 2.
template <int DR>
__device__ __forceinline__ i64 key_index_bytes(i64 blk, i64 off, int h, int e) {
  const i64 layer = blk / NBL_DIV;
  if (LAYOUT == RC_FLASH) return ((blk * BS + off) * KH + h) * DR + e;
  if (LAYOUT == RC_HND) return ((blk * KH + h) * BS + off) * DR + e;
  if (LAYOUT == RC_HEAD_MAJOR) return (((layer * KH + h) * NBL_DIV + (blk - layer * NBL_DIV)) * BS + off) * DR + e;
  if (LAYOUT == RC_KV_MERGED) return ((blk * BS + off) * (2 * KH) + 2 * h) * DR + e;
  return (((blk * KH + h) * (DR / X) + e / X) * BS + off) * X + e % X;
}
template <int DR>
__device__ __forceinline__ i64 value_index_bytes(i64 blk, i64 off, int h, int e) {
  if (LAYOUT == RC_KV_MERGED) return ((blk * BS + off) * (2 * KH) + 2 * h + 1) * DR + e;
  if (LAYOUT == RC_XPACKED) return ((blk * KH + h) * DR + e) * BS + off;
  if (LAYOUT == RC_XPACKED_SHUFFLED) return (((blk * KH + h) * (BS / X) + off / X) * DR + e) * X + off % X;
  return key_index_bytes<DR>(blk, off, h, e);
}

// Element offset of channel d (start of an aligned chunk) of kv head h at (blk, off).
__device__ __forceinline__ i64 key_index(i64 blk, i64 off, int h, int d) {
  if constexpr (PK4) return key_index_bytes<D / 2>(blk, off, h, d / 2);
  if (LAYOUT == RC_FLASH) return ((blk * BS + off) * KH + h) * D + d;
  if (LAYOUT == RC_HND) return ((blk * KH + h) * BS + off) * D + d;
  if (LAYOUT == RC_HEAD_MAJOR) return head_major_index(blk, off, h, d);
  if (LAYOUT == RC_KV_MERGED) return ((blk * BS + off) * (2 * KH) + 2 * h) * D + d;
  return (((blk * KH + h) * (D / X) + d / X) * BS + off) * X + d % X;
}

// kv_merged: the V row of head h right after its K row, in the key cache (vcache).
__device__ __forceinline__ i64 value_index(i64 blk, i64 off, int h, int d) {
  if constexpr (PK4) return value_index_bytes<D / 2>(blk, off, h, d / 2);
  if (LAYOUT == RC_FLASH) return ((blk * BS + off) * KH + h) * D + d;
  if (LAYOUT == RC_HND) return ((blk * KH + h) * BS + off) * D + d;
  if (LAYOUT == RC_HEAD_MAJOR) return head_major_index(blk, off, h, d);
  if (LAYOUT == RC_KV_MERGED) return ((blk * BS + off) * (2 * KH) + 2 * h + 1) * D + d;
  if (LAYOUT == RC_XPACKED) return ((blk * KH + h) * D + d) * BS + off;
  return (((blk * KH + h) * (BS / X) + off / X) * D + d) * X + off % X;
}

struct Params {
  const void* q;
  const void* k;
  const void* v;
  const void* key_cache_in;
  const void* value_cache_in;
  const void* slots;
  const void* pos;
  const void* cos;
  const void* sin;
  const float* k_scale;
  const float* v_scale;
  const int* layer;
  const void* q_norm_w;  // [D] weight of q's dtype or f32 (absent: a placeholder, never read)
  const void* k_norm_w;
#if RC_USE_ROPE
  const int* use_rope;  // the rotation switch (nonzero rotates), int32 []
#endif
#if RC_TEMP_FS
  const float* temp;  // the temperature factors, f32 [max_pos / RC_TEMP_FS + 1]
#endif
#if RC_CACHE_DT == 8
  const float* k_g;  // NVFP4: the global decode scales, f32 [] (the last operands)
  const float* v_g;
#endif
  void* q_out;
  void* k_out;
  void* kc;
  void* vc;
#if RC_TOKEN_SCALES
  float* k_sc;  // the scale-cache results [.., NB, KH, BS] (aliased to the k_scale / v_scale operands)
  float* v_sc;
#endif
  // the operands' leading dims (the extra operands too)
  i64 dim0[14 + (RC_USE_ROPE != 0) + (RC_TEMP_FS > 0) + 2 * (RC_CACHE_DT == 8)];
};

// Row of one token's head h (h < QH: q, else k head h - QH) in the rotation outputs (q_out, k_out).
__device__ __forceinline__ i64 row_of(i64 t, int h) {
  return h < QH ? (t * QH + h) * (i64)D : (t * KH + (h - QH)) * (i64)D;
}
// The inputs' rows (elements): separate q [T, QH, D], k/v [T, KH, D], or with RC_QKV each operand the
// fused [T, QH + 2 KH, D] (q heads, then k heads, then v heads of a token).
#ifndef RC_QKV
#define RC_QKV 0
#endif
constexpr bool QKV = RC_QKV != 0;
static_assert(!QGATE || QKV, "RC_QGATE: the fused QKV input");
// RC_QGATE: each q head followed by its gate (2 QH q-side heads a token; the gates are never read).
constexpr i64 IN_QROW = QKV ? (i64)((QGATE ? 2 : 1) * QH + 2 * KH) * D : (i64)QH * D;  // per token in q's operand
constexpr i64 IN_KVROW = QKV ? (i64)((QGATE ? 2 : 1) * QH + 2 * KH) * D : (i64)KH * D;  // ... in k's and v's
constexpr i64 IN_KOFF = QKV ? (i64)((QGATE ? 2 : 1) * QH) * D : 0;
constexpr i64 IN_VOFF = QKV ? (i64)((QGATE ? 2 : 1) * QH + KH) * D : 0;
// Row of token t's head h (h < QH: q, else k head h - QH) in the rotation inputs (q, k).
__device__ __forceinline__ i64 in_row_of(i64 t, int h) {
  return h < QH ? t * IN_QROW + (i64)(QGATE ? 2 * h : h) * D : t * IN_KVROW + IN_KOFF + (i64)(h - QH) * D;
}
// Row of token t's kv head h in v.
__device__ __forceinline__ i64 v_row_of(i64 t, int h) { return t * IN_KVROW + IN_VOFF + (i64)h * D; }

// The slots this call writes: slot s in [0, n) lands at cache slot base + s (base: the layer's first).
struct SlotRange {
  i64 n, base;
};

// The buffer V rows go to: the value cache, or kv_merged's one array.
__device__ __forceinline__ void* vcache(const Params& p) { return MERGED ? p.kc : p.vc; }

// Cache slot of token t if it writes the cache, else -1.
__device__ __forceinline__ i64 valid_slot(const Params& p, i64 t, SlotRange r) {
  const i64 s = load_index(p.slots, t, RC_SLOT64 != 0);
  return (s >= 0 && s < r.n) ? r.base + s : -1;
}

// ---- cos/sin values ---------------------------------------------------------------------------
// Widest vector (elements) for N table values starting at a multiple of A inside a row.
constexpr int tab_vec(int n, int a) {
  int v = 16 / S_TAB;
  while (v > 1 && (n % v != 0 || a % v != 0 || TW % v != 0)) v /= 2;
  return v;
}

__device__ __forceinline__ float tab_value(raw_tab raw) {
  return to_f32<TAB_DT>(raw);  // exact: tables are never rounded to the input dtype
}

// Index i of an int32/int64 buffer, read by a load that ptxas issues only after what computes the
// address `dep` (the load's address gets `dep >> 63` added: 0, device addresses are < 2^63). Used
// to keep the independent q/k loads ahead of the position load: left alone, ptxas schedules the
// position's consumers first and the q/k loads then wait for the position (two memory round
// trips in a row instead of one).
__device__ __forceinline__ i64 load_index_after(const void* base, i64 i, bool is64, const void* dep) {
#ifdef __CUDA_ARCH__
  i64 r;
  if (is64) {
    asm("{\n\t.reg .u64 t, a;\n\tshr.u64 t, %2, 63;\n\tadd.u64 a, %1, t;\n\tld.global.s64 %0, [a];\n\t}"
        : "=l"(r) : "l"(static_cast<const i64*>(base) + i), "l"(dep));
  } else {
    int v;
    asm("{\n\t.reg .u64 t, a;\n\tshr.u64 t, %2, 63;\n\tadd.u64 a, %1, t;\n\tld.global.s32 %0, [a];\n\t}"
        : "=r"(v) : "l"(static_cast<const int*>(base) + i), "l"(dep));
    r = v;
  }
  return r;
#else
  (void)dep;
  return load_index(base, i, is64);
#endif
}

// ---- the units --------------------------------------------------------------------------------
// One function per kind of unit, each doing its unit from its first load to its last store.
constexpr int NTV = NEOX ? W : (FULL ? W : W / 2);  // table values per table per rotation unit

// out[0..N) = table[idx .. idx + N), idx a multiple of A, as f32 (native: rounded to the input dtype).
template <int N, int A>
__device__ __forceinline__ void load_tab(const void* base, i64 idx, float* out) {
  constexpr int V = tab_vec(N, A);
  union {
    typename VecOf<V * S_TAB>::T v;
    raw_tab e[V];
  } u;
#pragma unroll
  for (int k = 0; k < N; k += V) {
    u.v = *reinterpret_cast<const typename VecOf<V * S_TAB>::T*>(static_cast<const char*>(base) + (idx + k) * S_TAB);
#pragma unroll
    for (int e = 0; e < V; ++e) out[k + e] = tab_value(u.e[e]);
  }
}

// M-RoPE: the stream of table column c (a "half" column is frequency c; a "full" column serves the
// pair of its frequency: NeoX c mod R/2, GPT-J c / 2).
__device__ __forceinline__ int col_stream(i64 c) {
  const i64 f = !FULL ? c : (NEOX ? c % HALF : c / 2);
  return rc_mrope_stream(f, MROPE, RC_MROPE_T, RC_MROPE_H, RC_MROPE_W);
}

// load_tab for M-RoPE: out[e] = table[rows[stream of column c0 + e] + c0 + e]. Stream 0's values
// first, then each other stream's row, loaded only where one of the chunk's columns takes it,
// replaces its columns (one vector load per stream used, one temporary row in registers).
template <int N, int A>
__device__ __forceinline__ void load_tab3(const void* base, const i64* rows, i64 c0, float* out) {
  load_tab<N, A>(base, rows[0] + c0, out);
#pragma unroll
  for (int st = 1; st < 3; ++st) {
    bool used = false;
#pragma unroll
    for (int e = 0; e < N; ++e) used |= col_stream(c0 + e) == st;
    if (used) {
      float r[N];
      load_tab<N, A>(base, rows[st] + c0, r);
#pragma unroll
      for (int e = 0; e < N; ++e) out[e] = col_stream(c0 + e) == st ? r[e] : out[e];
    }
  }
}

// ---- M-RoPE merged rows (RC_MROW) --------------------------------------------------------------
// The block's tokens' cos and sin rows, column c of token t being table[clamp(pos[stream(c), t]) *
// TW + c] (the value load_tab3 selects), copied to shared memory once per block; a rotation unit
// then reads its token's row there as the 1-D op reads table row `position` (load_tab, and the
// packed native path's load_words): the same bytes in the same arithmetic, so the same bits. The
// stream choice and the three row loads happen once per (token, column), not once per (token, head,
// column). Each thread builds its share (entries tid, tid + NT, ...; every RC_SPLIT part the whole
// rows) and then arrives once at the block's barrier 0 (mrow_share): a thread whose first unit is a
// rotation unit does so in that unit after issuing its q/k loads (they overlap the build), any
// other before its first unit; a rotation unit reads the rows only after its thread's arrival.
enum : int { MROW_N = MROW ? TPB * TW : 1 };  // entries per table
static_assert(!MROW || 2 * MROW_N * S_TAB <= 32768, "RC_MROW: the merged rows fit 32 KiB of shared memory");
struct MRows {
  alignas(16) raw_tab cos[MROW_N];  // token tt's row at tt * TW (rows of TW values: the vector
  alignas(16) raw_tab sin[MROW_N];  // loads stay aligned as in the tables)
};

#ifdef RC_EMULATE
// The host's merged rows: a namespace-scope static, one per emulation library (a static local of an
// inline function is one object process-wide, shared by every loaded library of any TPB and TW).
static MRows rc_emu_rows;
#endif

// One arrival at barrier 0 of the block. Not `.aligned`: the threads of a warp may arrive from
// different instructions (a rotation unit, or before the first unit), which sm_70+ allows; the
// barrier orders the shared-memory stores before it against the loads after it.
__device__ __forceinline__ void block_arrive() {
#ifdef __CUDA_ARCH__
  asm volatile("barrier.sync 0;" ::: "memory");
#else
  __syncthreads();
#endif
}

// This thread's share of the merged rows of tokens t0 .. t0 + TPB - 1 (tokens >= T: none), then its
// one arrival at the barrier. Entries in batches of MROW_K: every position load of a batch, then
// every table load, then the stores (one dependent round trip per batch, not per entry).
enum : int { MROW_K = (MROW_N + NT - 1) / NT < 4 ? (MROW_N + NT - 1) / NT : 4 };  // entries per batch
__device__ __forceinline__ void mrow_share(const Params& p, i64 T, i64 max_pos, i64 t0, MRows* m) {
  const raw_tab* cos = static_cast<const raw_tab*>(p.cos);
  const raw_tab* sin = static_cast<const raw_tab*>(p.sin);
#pragma unroll 1
  for (int i0 = (int)threadIdx.x; i0 < MROW_N; i0 += MROW_K * NT) {
    i64 at[MROW_K];  // table index of each entry, -1: none
#pragma unroll
    for (int k = 0; k < MROW_K; ++k) {
      const int i = i0 + k * NT, c = i % TW;
      const i64 t = t0 + i / TW;
      at[k] = -1;
      if (i < MROW_N && t < T) {
        i64 r = load_index(p.pos, col_stream(c) * T + t, RC_POS64 != 0);
        r = r < 0 ? 0 : (r >= max_pos ? max_pos - 1 : r);
        at[k] = r * TW + c;
      }
    }
    raw_tab vc[MROW_K], vs[MROW_K];
#pragma unroll
    for (int k = 0; k < MROW_K; ++k) {
      if (at[k] >= 0) vc[k] = cos[at[k]], vs[k] = sin[at[k]];
    }
#pragma unroll
    for (int k = 0; k < MROW_K; ++k) {
      if (at[k] >= 0) m->cos[i0 + k * NT] = vc[k], m->sin[i0 + k * NT] = vs[k];
    }
  }
  block_arrive();
}

// ---- native precision with packed multiplies (CUDA: bf16 on sm_90+, f16 on sm_53+) -------------
// NeoX, table dtype == input dtype: r(r(a*c) - r(b*s)), r(r(b*c) + r(a*s)) with the products done by
// mul.rn.{bf16,f16}x2, two per instruction: a product of two bf16 (f16) values is exact in f32,
// so the packed multiply's one rounding equals rc_round_to(rc_mul(a, c)) (checked for all 2^32
// operand pairs on the H200); the sum is an f32 operation and one final rounding, as in
// rc_rotate_pair. Elsewhere (host emulation, other archs, other dtypes) the scalar path.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= 900 || (RC_DT == 2 /* RC_F16 */ && __CUDA_ARCH__ >= 530))
#define RC_PACKED_NATIVE 1
#endif
constexpr bool PACKED_NATIVE =
#ifdef RC_PACKED_NATIVE
    ARITH == DT && NEOX && S_IN == 2 && W % 2 == 0 && (MROPE == 0 || MROW);  // "rounded", one row
#else
    false;
#endif

// W table values of one table as packed words (PACKED_NATIVE: 16-bit values, W even).
constexpr int TWB = (S_TAB == 2 && W * S_TAB >= 4) ? W * S_TAB : 4;  // bytes (4: unused placeholder)
union TabWords {
  VecOf<TWB>::T v;
  unsigned int w[TWB / 4];
};

__device__ __forceinline__ TabWords load_words(const void* base, i64 idx) {
  TabWords t;
  t.v = *reinterpret_cast<const VecOf<TWB>::T*>(static_cast<const char*>(base) + idx * S_TAB);
  return t;
}

__device__ __forceinline__ unsigned int mul2(unsigned int x, unsigned int y) {
  unsigned int r = 0;
#ifdef RC_PACKED_NATIVE
  if constexpr (DT == RC_BF16) {
    asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(y));
  } else {
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(y));
  }
#endif
  return r;
}

// The two halves of a packed pair as f32 (exact).
__device__ __forceinline__ float lo_f32(unsigned int x) { return to_f32<DT>(x & 0xffffu); }
__device__ __forceinline__ float hi_f32(unsigned int x) {
  if (DT == RC_BF16) return __uint_as_float(x & 0xffff0000u);
  return to_f32<DT>(x >> 16);
}

__device__ __forceinline__ void rot_native_packed(const Chunk& a, const Chunk& b, const TabWords& c,
                                                  const TabWords& s, const TabWords& c2, const TabWords& s2,
                                                  Chunk& oa, Chunk& ob) {
#pragma unroll
  for (int k = 0; k < W / 2 && k < TWB / 4; ++k) {
    const unsigned int cb = FULL ? c2.w[k] : c.w[k], sb = FULL ? s2.w[k] : s.w[k];
    const unsigned int ac = mul2(a.w[k], c.w[k]), bs = mul2(b.w[k], s.w[k]);
    const unsigned int bc = mul2(b.w[k], cb), as = mul2(a.w[k], sb);
    oa.w[k] = pack_out2(rc_sub(lo_f32(ac), lo_f32(bs)), rc_sub(hi_f32(ac), hi_f32(bs)));
    ob.w[k] = pack_out2(rc_add(lo_f32(bc), lo_f32(as)), rc_add(hi_f32(bc), hi_f32(as)));
  }
}
// ---- end of native precision with packed multiplies ---------------------------------------------

// ---- QK-RMSNorm ------------------------------------------------------------------------------
// Per (token, head) row x of q (RC_Q_NORM) or k (RC_K_NORM), before the rotation:
//   S = tree(r32(x_i^2)) (rc_tree_sum: the spec's halving tree), inv = rc_rms_inv(S, D, eps),
//   n_i = r(r32(w_i * r(r32(x_i * inv))))
// and n replaces x as the rotation's input (jax_rope_cache/reference.py). NORM_LANES: the lanes of
// a head hold subtrees of S and finish it with shuffles (norm_lanes); otherwise each unit builds S
// from the whole row (norm_generic, the row's other chunks are L1 hits).
__device__ __forceinline__ float norm_eps() { return __uint_as_float((unsigned int)RC_NORM_EPS_BITS); }

__device__ __forceinline__ float sq_of(raw_in x) {
  const float f = to_f32<DT>(x);
  return rc_mul(f, f);
}

// The tree of a chunk's W squares (a subtree of S: chunks start at multiples of W, W a power of two).
__device__ __forceinline__ float chunk_sq_sum(const Chunk& x) {
  return rc_tree_sum<0, W>([&](int e) { return sq_of(x.e[e]); });
}

// S of the row starting at `row` (generic: any D, any R).
__device__ __forceinline__ float row_sq_sum(const char* row) {
  return rc_tree_sum<0, D>([&](int i) { return sq_of(load_chunk(row, (i / W) * W).e[i % W]); });
}

// N weights from w[idx..], as f32 (WDT: the weight's RcDtype), in the widest aligned accesses.
template <int WDT, int N>
__device__ __forceinline__ void load_weights(const void* w, int idx, float* out) {
  constexpr int SW = WDT == RC_F32 ? 4 : 2;
  constexpr int V = (16 / SW) < N ? 16 / SW : N;  // N and idx are multiples of V (powers of two)
  union {
    typename VecOf<V * SW>::T v;
    typename RawOf<SW>::T e[V];
  } u;
#pragma unroll
  for (int k = 0; k < N; k += V) {
    u.v = *reinterpret_cast<const typename VecOf<V * SW>::T*>(static_cast<const char*>(w) + (idx + k) * SW);
#pragma unroll
    for (int e = 0; e < V; ++e) out[k + e] = to_f32<WDT>(u.e[e]);
  }
}

// One normalised value before its final rounding (RC_NORM_TYPE): rms w * r(x * inv), gemma
// r32(x * inv) * r32(1 + w), weightless x * inv (w unused).
__device__ __forceinline__ float norm_value(float x, float w, float inv) {
  if constexpr (NORM_TYPE == RC_NORM_GEMMA) return rc_norm_gemma(x, inv, w);
  if constexpr (NORM_TYPE == RC_NORM_WEIGHTLESS) return rc_norm_weightless(x, inv);
  return rc_mul(w, rc_round_to(rc_mul(x, inv), DT));
}

// The chunk x normalised by `inv` and weighted by wc (weights of q's dtype, already loaded),
// rounded to the input dtype. 16-bit on sm_90: the weight product r(w * y) of two 16-bit values is
// one packed mul.rn (the same bits as the f32 product rounded once, checked for all 2^32 pairs: see
// "native precision with packed multiplies"), and y = r(x * inv) two values per cvt.
__device__ __forceinline__ Chunk norm_chunk_w(const Chunk& x, const Chunk& wc, float inv) {
#ifdef RC_PACKED_NATIVE
  if constexpr (S_IN == 2 && W % 2 == 0 && NORM_TYPE == RC_NORM_RMS) {
    Chunk n;
#pragma unroll
    for (int k = 0; k < W / 2; ++k)
      n.w[k] = mul2(wc.w[k], pack_out2(rc_mul(lo_f32(x.w[k]), inv), rc_mul(hi_f32(x.w[k]), inv)));
    return n;
  }
#endif
  float n[W];
#pragma unroll
  for (int e = 0; e < W; ++e) n[e] = norm_value(to_f32<DT>(x.e[e]), to_f32<DT>(wc.e[e]), inv);
  return chunk_from(n);
}

// The chunk of channels c0.. of a row, normalised by `inv` and weighted by w[c0..] (WDT: w's dtype).
template <int WDT>
__device__ __forceinline__ Chunk norm_chunk(const Chunk& x, const void* w, int c0, float inv) {
  if constexpr (NORM_TYPE == RC_NORM_WEIGHTLESS) {  // no weight (its operand a placeholder)
    float n[W];
#pragma unroll
    for (int e = 0; e < W; ++e) n[e] = rc_norm_weightless(to_f32<DT>(x.e[e]), inv);
    return chunk_from(n);
  }
  if constexpr (WDT == DT) return norm_chunk_w(x, load_chunk(w, c0), inv);
  float wv[W], n[W];
  load_weights<WDT, W>(w, c0, wv);
#pragma unroll
  for (int e = 0; e < W; ++e) n[e] = norm_value(to_f32<DT>(x.e[e]), wv[e], inv);
  return chunk_from(n);
}

// Rotation unit u -> (token in the block, rotated head, chunk j), and the start of its chunk j.
// KPAIRS: q units (token, q head, j) first, then k units (token pair, k head, j, token parity).
struct RotIdx {
  int tt, h, j;
};
__device__ __forceinline__ RotIdx rot_idx(int u) {
  if constexpr (KPAIRS) {
    if (u >= N_QROT) {
      const int v = u - N_QROT, w = v >> 1, r = w % (KH * P_DIV);
      return RotIdx{2 * (w / (KH * P_DIV)) + (v & 1), QH + r / P_DIV, r % P_DIV};
    }
    const int tt = u / (QH * P_DIV), r = u % (QH * P_DIV);
    return RotIdx{tt, r / P_DIV, r % P_DIV};
  }
  const int tt = u / UROT_DIV, r = u % UROT_DIV;
  return RotIdx{tt, r / P_DIV, r % P_DIV};
}
__device__ __forceinline__ const char* rot_src(const Params& p, i64 t, int h, int j) {
  return static_cast<const char*>(h >= QH ? p.k : p.q) + (in_row_of(t, h) + ROFF + j * W) * S_IN;
}
// The start of token t's q/k head row h in the inputs.
__device__ __forceinline__ const char* row_src(const Params& p, i64 t, int h) {
  return static_cast<const char*>(h >= QH ? p.k : p.q) + in_row_of(t, h) * S_IN;
}

constexpr int NSUB = NEOX ? 2 : 1;  // subtrees per lane: NeoX chunk j (first half) and j + P (second)
struct LaneSums {
  float s[NSUB];
};
__device__ __forceinline__ LaneSums lane_sums(const Chunk& a, const Chunk& b) {
  LaneSums r;
  r.s[0] = chunk_sq_sum(a);
  if (NEOX) r.s[NSUB - 1] = chunk_sq_sum(b);
  return r;
}

#ifdef RC_EMULATE
// One host thread runs the units one after another, so the butterfly's other lanes are rebuilt:
// lane i of the group is rotation unit u0 + i*st (st = 1, u0 = u rounded down to P; paired k units:
// st = 2, u0 = the unit of chunk 0 of the same token: on the GPU, unit u runs on lane u % 32 since
// NT % 32 == 0); each lane's sums come from its own chunks through the same rot_idx / rot_src /
// lane_sums, then the same xor levels as the shuffles. Checked: the P units are the P chunks of
// one (token, head) in order, and lane u's rebuilt sums equal its own.
static int rc_emu_errors = 0;
// Counts an error unless the P lanes of unit u's group (st = 1: u rounded down to P; paired k units:
// st = 2 from the unit of chunk 0 of the same token) are the P chunks of its (token, head) in order.
__device__ __forceinline__ void emu_check_group(int u, bool paired) {
  const int st = paired ? 2 : 1;
  const int u0 = paired ? u - ((u - N_QROT) % (2 * P_DIV) - (u & 1)) : u - u % P_DIV;
  const RotIdx me = rot_idx(u);
  if ((u - u0) % st != 0 || (u - u0) / st != me.j) ++rc_emu_errors;
  for (int i = 0; i < P; ++i) {
    const RotIdx o = rot_idx(u0 + i * st);
    if (o.tt != me.tt || o.h != me.h || o.j != i) ++rc_emu_errors;
  }
}
#endif

// S of unit u's (token, head) row: the group's P lanes (one head) exchange their subtree sums by
// xor shuffles 1, 2, ..P/2 (each level adds two subtrees of the balanced tree: the same bits in
// every lane); NeoX adds the two halves last (the tree's top split is D/2).
// KPAIRS k units: the P lanes are every other lane (same parity) of 2P aligned lanes, the shuffles
// xor 2, 4, ..P (the same tree levels), the mask those P lanes.
constexpr unsigned int every_other_bits(int n) {
  unsigned int m = 0;
  for (int i = 0; i < n && 2 * i < 32; ++i) m |= 1u << (2 * i);
  return m;
}
#ifndef RC_EMULATE
// The shuffle mask of this lane's group: P aligned lanes, or (paired k units) every other lane of
// 2P aligned lanes (sh = 1: the xor offsets doubled).
__device__ __forceinline__ unsigned int group_mask(bool paired, int& sh) {
  const unsigned int lane = threadIdx.x & 31u;
  unsigned int mask = P == 32 ? 0xffffffffu : ((1u << (P & 31)) - 1u) << (lane & ~(unsigned int)(P - 1));
  sh = 0;
  if constexpr (KPAIRS && 2 * P <= 32) {
    if (paired) {
      mask = every_other_bits(P) << ((lane & ~(unsigned int)(2 * P - 1)) | (lane & 1u));
      sh = 1;
    }
  }
  return mask;
}
#endif
__device__ __forceinline__ float norm_lanes(const Params& p, i64 t0, int u, bool is_k, const Chunk& a,
                                            const Chunk& b) {
  LaneSums v = lane_sums(a, b);
  const bool paired = KPAIRS && is_k;
#ifdef RC_EMULATE
  const RotIdx me = rot_idx(u);
  emu_check_group(u, paired);
  LaneSums g[P_DIV];
  for (int i = 0; i < P; ++i) {
    const char* src = rot_src(p, t0 + me.tt, me.h, i);
    Chunk oa = load_chunk(src, 0), ob = oa;
    if (NEOX) ob = load_chunk(src, HALF);
    g[i] = lane_sums(oa, ob);
  }
  for (int k = 0; k < NSUB; ++k)
    if (__float_as_uint(g[me.j].s[k]) != __float_as_uint(v.s[k])) ++rc_emu_errors;
  for (int off = 1; off < P; off <<= 1) {
    LaneSums n[P_DIV];
    for (int i = 0; i < P; ++i)
      for (int k = 0; k < NSUB; ++k) n[i].s[k] = rc_add(g[i].s[k], g[i ^ off].s[k]);
    for (int i = 0; i < P; ++i) g[i] = n[i];
  }
  v = g[me.j];
#else
  (void)p, (void)t0, (void)u;
  int sh = 0;
  const unsigned int mask = group_mask(paired, sh);
#pragma unroll
  for (int off = 1; off < P; off <<= 1) {
#pragma unroll
    for (int k = 0; k < NSUB; ++k) v.s[k] = rc_add(v.s[k], __shfl_xor_sync(mask, v.s[k], off << sh));
  }
#endif
  return NEOX ? rc_add(v.s[0], v.s[NSUB - 1]) : v.s[0];
}

// A rotation unit's weight chunks (EARLY_W: loaded with its q/k chunks).
struct WeightChunks {
  Chunk a, b;
};

// Rotation unit u's chunks a (channels j*W..) and b (NeoX: HALF + j*W..) replaced by their
// normalised values, if its tensor has a norm (WDT: that weight's dtype).
template <int WDT>
__device__ __forceinline__ void norm_rot(const Params& p, i64 t0, int u, bool is_k, const char* src, int j,
                                         const void* w, Chunk& a, Chunk& b, const WeightChunks& ew) {
  float S;
  if constexpr (NORM_LANES) {
    S = norm_lanes(p, t0, u, is_k, a, b);
  } else {
    S = row_sq_sum(src - (ROFF + j * W) * S_IN);
  }
  const float inv = rc_rms_inv(S, D, norm_eps());
  if constexpr (EARLY_W) {
    a = norm_chunk_w(a, ew.a, inv);
    if (NEOX) b = norm_chunk_w(b, ew.b, inv);
  } else {
    a = norm_chunk<WDT>(a, w, ROFF + j * W, inv);
    if (NEOX) b = norm_chunk<WDT>(b, w, ROFF + HALF + j * W, inv);
  }
}

__device__ __forceinline__ void norm_rot_unit(const Params& p, i64 t0, int u, bool is_k, const char* src, int j,
                                              Chunk& a, Chunk& b, const WeightChunks& ew) {
  if constexpr (Q_NORM == K_NORM) {  // both (one weight dtype) or neither
    if constexpr (Q_NORM >= 0) norm_rot<Q_NORM>(p, t0, u, is_k, src, j, is_k ? p.k_norm_w : p.q_norm_w, a, b, ew);
  } else if (is_k) {  // a head's lanes all take the same side (shuffle masks are per head)
    if constexpr (K_NORM >= 0) norm_rot<K_NORM>(p, t0, u, true, src, j, p.k_norm_w, a, b, ew);
  } else {
    if constexpr (Q_NORM >= 0) norm_rot<Q_NORM>(p, t0, u, false, src, j, p.q_norm_w, a, b, ew);
  }
}

// Pass-through chunk c of a row (R < D: never NORM_LANES), normalised if its tensor has a norm.
template <int WDT>
__device__ __forceinline__ Chunk norm_pass(const char* row, int c, const void* w, const Chunk& x) {
  return norm_chunk<WDT>(x, w, c * W, rc_rms_inv(row_sq_sum(row), D, norm_eps()));
}

__device__ __forceinline__ Chunk norm_pass_unit(const Params& p, bool is_k, const char* row, int c, const Chunk& x) {
  if constexpr (Q_NORM == K_NORM) {
    if constexpr (Q_NORM >= 0) return norm_pass<Q_NORM>(row, c, is_k ? p.k_norm_w : p.q_norm_w, x);
  } else if (is_k) {
    if constexpr (K_NORM >= 0) return norm_pass<K_NORM>(row, c, p.k_norm_w, x);
  } else {
    if constexpr (Q_NORM >= 0) return norm_pass<Q_NORM>(row, c, p.q_norm_w, x);
  }
  return x;
}

// 1/scale of kv head h: per head (scale[h]) or the block's one value.
__device__ __forceinline__ float head_inv(const float* scale, int h, float block_inv, bool heads) {
  return heads ? rc_inv_scale(scale[h]) : block_inv;
}
// ---- end of QK-RMSNorm ---------------------------------------------------------------------------

// The table values of rotation chunk j (rot_unit's scalar path) from tables tcos, tsin: row trow, or
// (M3: M-RoPE read from the global tables) each column from the row trows[stream].
struct TabVals {
  float tc[NTV], ts[NTV], tc2[NEOX && FULL ? W : 1], ts2[NEOX && FULL ? W : 1];
};
template <bool M3>
__device__ __forceinline__ void load_chunk_tabs(const void* tcos, const void* tsin, i64 trow, const i64* trows, int j,
                                                TabVals& tv) {
  const int c0 = NEOX ? j * W : (FULL ? j * W : j * W / 2);
  if constexpr (M3) {
    load_tab3<NTV, NTV>(tcos, trows, c0, tv.tc);
    load_tab3<NTV, NTV>(tsin, trows, c0, tv.ts);
    if (NEOX && FULL) {
      load_tab3<W, W>(tcos, trows, HALF + j * W, tv.tc2);
      load_tab3<W, W>(tsin, trows, HALF + j * W, tv.ts2);
    }
  } else {
    load_tab<NTV, NTV>(tcos, trow + c0, tv.tc);
    load_tab<NTV, NTV>(tsin, trow + c0, tv.ts);
    if (NEOX && FULL) {
      load_tab<W, W>(tcos, trow + HALF + j * W, tv.tc2);
      load_tab<W, W>(tsin, trow + HALF + j * W, tv.ts2);
    }
  }
}

// The rotated f32 values of chunk a (NeoX: and its partner chunk b) with the table values tv.
__device__ __forceinline__ void rotate_chunk(const Chunk& a, const Chunk& b, const TabVals& tv, float* ya, float* yb) {
  if (NEOX) {
#pragma unroll
    for (int e = 0; e < W; ++e) {  // pair (i, i + R/2), i = j*W + e
      const float cb = FULL ? tv.tc2[e] : tv.tc[e], sb = FULL ? tv.ts2[e] : tv.ts[e];
      rc_rotate_pair(to_f32<DT>(a.e[e]), to_f32<DT>(b.e[e]), tv.tc[e], tv.ts[e], cb, sb, ARITH, &ya[e], &yb[e]);
    }
  } else {
    (void)b, (void)yb;
#pragma unroll
    for (int e = 0; e < W; e += 2) {  // pair (2m, 2m + 1), m = (j*W + e) / 2
      const float ca = FULL ? tv.tc[e] : tv.tc[e / 2], sa = FULL ? tv.ts[e] : tv.ts[e / 2];
      const float cb = FULL ? tv.tc[e + 1] : ca, sb = FULL ? tv.ts[e + 1] : sa;
      rc_rotate_pair(to_f32<DT>(a.e[e]), to_f32<DT>(a.e[e + 1]), ca, sa, cb, sb, ARITH, &ya[e], &ya[e + 1]);
    }
  }
}

// ---- model families (RC_USE_ROPE, RC_TEMP_FS, RC_NORM_AFTER; RC_ROT_OFF and RC_NORM_TYPE are in the
// index and norm helpers above) ---------------------------------------------------------------------
// Whether this call rotates: the use_rope operand (the same in every thread), else always.
__device__ __forceinline__ bool rope_on(const Params& p) {
#if RC_USE_ROPE
  return *p.use_rope != 0;
#else
  (void)p;
  return true;
#endif
}

// The temperature factor of a token at clamped position prow (< max_pos, so (prow + 1) / FS is inside
// the table's max_pos / FS + 1 entries).
__device__ __forceinline__ float temp_factor(const Params& p, i64 prow) {
#if RC_TEMP_FS
  return p.temp[(prow + 1) / RC_TEMP_FS];
#else
  (void)p, (void)prow;
  return 1.0f;
#endif
}

// r(r32(x * f)): a q chunk scaled by the temperature.
__device__ __forceinline__ Chunk scale_chunk(const Chunk& x, float f) {
  float y[W];
#pragma unroll
  for (int e = 0; e < W; ++e) y[e] = rc_mul(to_f32<DT>(x.e[e]), f);
  return chunk_from(y);
}

// Clamped position of token t (positions [T]).
__device__ __forceinline__ i64 clamped_pos(const Params& p, i64 max_pos, i64 t) {
  const i64 r = load_index(p.pos, t, RC_POS64 != 0);
  return r < 0 ? 0 : (r >= max_pos ? max_pos - 1 : r);
}

// Rotation chunk j of token t's q/k head h, rotated and rounded (the host emulation's other lanes of
// the norm after the rotation).
__device__ __forceinline__ void rot_out_chunks(const Params& p, i64 T, i64 max_pos, i64 t, int h, int j, Chunk& oa,
                                               Chunk& ob) {
  const char* src = rot_src(p, t, h, j);
  Chunk a = load_chunk(src, 0), b = a;
  if (NEOX) b = load_chunk(src, HALF);
  i64 trows[MROPE ? 3 : 1];
#pragma unroll
  for (int st = 0; st < (MROPE ? 3 : 1); ++st) {
    const i64 r = load_index(p.pos, st * T + t, RC_POS64 != 0);
    trows[st] = (r < 0 ? 0 : (r >= max_pos ? max_pos - 1 : r)) * TW;
  }
  TabVals tv;
  load_chunk_tabs<MROPE != 0>(p.cos, p.sin, trows[0], trows, j, tv);
  float ya[W], yb[NEOX ? W : 1];
  rotate_chunk(a, b, tv, ya, yb);
  oa = ob = chunk_from(ya);
  if (NEOX) ob = chunk_from(yb);
}

enum : int { HALF_DIV = HALF > 0 ? HALF : 1, LOG_CH = CH <= 1 ? 0 : 1 + (CH >= 4) + (CH >= 8) + (CH >= 16) + (CH >= 32) + (CH >= 64) + (CH >= 128) };
// Chunk c of token t's head row h as a rotating call writes it before the norm after the rotation:
// rotated and rounded (the rotary channels), else the input.
__device__ __forceinline__ Chunk out_chunk(const Params& p, i64 T, i64 max_pos, i64 t, int h, int c) {
  const int l = c * W - ROFF;  // rotary channels [ROFF, ROFF + R)
  if (l >= 0 && l < R) {
    Chunk oa, ob;
    rot_out_chunks(p, T, max_pos, t, h, NEOX ? (l % HALF_DIV) / W : l / W, oa, ob);
    return NEOX && l >= HALF ? ob : oa;
  }
  return load_chunk(row_src(p, t, h), c * W);
}

// S of the row out_chunk gives, by the spec's tree, for rows no lane group holds (partial rotary ...).
// CH a power of two: every chunk is a subtree (chunk_sq_sum), combined in a loop over the chunks by
// a carry stack (the balanced tree's levels: left + right); otherwise the unrolled tree, each chunk
// computed at its first leaf.
__device__ __forceinline__ float out_row_sq_sum(const Params& p, i64 T, i64 max_pos, i64 t, int h) {
  if constexpr (is_pow2(CH)) {
    float st[LOG_CH > 0 ? LOG_CH : 1], s = 0.0f;
#pragma unroll 1
    for (int c = 0; c < CH; ++c) {
      s = chunk_sq_sum(out_chunk(p, T, max_pos, t, h, c));
      bool carry = true;  // chunk c closes the subtrees of its trailing one bits
#pragma unroll
      for (int k = 0; k < LOG_CH; ++k) {
        if (carry && ((c >> k) & 1) == 0) st[k] = s, carry = false;
        if (carry) s = rc_add(st[k], s);
      }
    }
    return s;
  } else {
    int cur = -1;
    float y[W];
    return rc_tree_sum<0, D>([&](int i) {
      if (i / W != cur) {
        cur = i / W;
        const Chunk x = out_chunk(p, T, max_pos, t, h, cur);
#pragma unroll
        for (int e = 0; e < W; ++e) y[e] = to_f32<DT>(x.e[e]);
      }
      return rc_mul(y[i % W], y[i % W]);
    });
  }
}

// norm_lanes over the rotated chunks a, b (RC_NORM_AFTER): the same butterfly; the host emulation
// rebuilds the other lanes' rotated chunks (rot_out_chunks). A function of its own so that norm_lanes,
// and the kernels without the norm after the rotation, stay as they were.
__device__ __forceinline__ float norm_lanes_after(const Params& p, i64 T, i64 max_pos, i64 t0, int u, bool is_k,
                                                  const Chunk& a, const Chunk& b) {
  LaneSums v = lane_sums(a, b);
  const bool paired = KPAIRS && is_k;
#ifdef RC_EMULATE
  const RotIdx me = rot_idx(u);
  emu_check_group(u, paired);
  LaneSums g[P_DIV];
  for (int i = 0; i < P; ++i) {
    Chunk oa, ob;
    rot_out_chunks(p, T, max_pos, t0 + me.tt, me.h, i, oa, ob);
    g[i] = lane_sums(oa, ob);
  }
  for (int k = 0; k < NSUB; ++k)
    if (__float_as_uint(g[me.j].s[k]) != __float_as_uint(v.s[k])) ++rc_emu_errors;
  for (int off = 1; off < P; off <<= 1) {
    LaneSums n[P_DIV];
    for (int i = 0; i < P; ++i)
      for (int k = 0; k < NSUB; ++k) n[i].s[k] = rc_add(g[i].s[k], g[i ^ off].s[k]);
    for (int i = 0; i < P; ++i) g[i] = n[i];
  }
  v = g[me.j];
#else
  (void)p, (void)T, (void)max_pos, (void)t0, (void)u;
  int sh = 0;
  const unsigned int mask = group_mask(paired, sh);
#pragma unroll
  for (int off = 1; off < P; off <<= 1) {
#pragma unroll
    for (int k = 0; k < NSUB; ++k) v.s[k] = rc_add(v.s[k], __shfl_xor_sync(mask, v.s[k], off << sh));
  }
#endif
  return NEOX ? rc_add(v.s[0], v.s[NSUB - 1]) : v.s[0];
}

// Rotation unit u's rotated chunks a, b normalised (RC_NORM_AFTER, a rotating call): the row's S over
// the head's lanes (NORM_LANES) or from the whole rotated row.
template <int WDT>
__device__ __forceinline__ void norm_after_rot(const Params& p, i64 T, i64 max_pos, i64 t0, int u, bool is_k, int j,
                                               const void* w, Chunk& a, Chunk& b, const WeightChunks& ew) {
  const RotIdx ix = rot_idx(u);
  float S;
  if constexpr (NORM_LANES) {
    S = norm_lanes_after(p, T, max_pos, t0, u, is_k, a, b);
  } else {
    S = out_row_sq_sum(p, T, max_pos, t0 + ix.tt, ix.h);
  }
  const float inv = rc_rms_inv(S, D, norm_eps());
  if constexpr (EARLY_W) {
    a = norm_chunk_w(a, ew.a, inv);
    if (NEOX) b = norm_chunk_w(b, ew.b, inv);
  } else {
    a = norm_chunk<WDT>(a, w, ROFF + j * W, inv);
    if (NEOX) b = norm_chunk<WDT>(b, w, ROFF + HALF + j * W, inv);
  }
}

__device__ __forceinline__ void norm_after_unit(const Params& p, i64 T, i64 max_pos, i64 t0, int u, bool is_k, int j,
                                                Chunk& a, Chunk& b, const WeightChunks& ew) {
  if constexpr (Q_NORM == K_NORM) {
    if constexpr (Q_NORM >= 0)
      norm_after_rot<Q_NORM>(p, T, max_pos, t0, u, is_k, j, is_k ? p.k_norm_w : p.q_norm_w, a, b, ew);
  } else if (is_k) {
    if constexpr (K_NORM >= 0) norm_after_rot<K_NORM>(p, T, max_pos, t0, u, true, j, p.k_norm_w, a, b, ew);
  } else {
    if constexpr (Q_NORM >= 0) norm_after_rot<Q_NORM>(p, T, max_pos, t0, u, false, j, p.q_norm_w, a, b, ew);
  }
}

// Pass-through chunk c of token t's head h normalised with the rotated row's S (RC_NORM_AFTER).
template <int WDT>
__device__ __forceinline__ Chunk norm_pass_after(const Params& p, i64 T, i64 max_pos, i64 t, int h, int c,
                                                 const void* w, const Chunk& x) {
  return norm_chunk<WDT>(x, w, c * W, rc_rms_inv(out_row_sq_sum(p, T, max_pos, t, h), D, norm_eps()));
}

__device__ __forceinline__ Chunk norm_pass_after_unit(const Params& p, i64 T, i64 max_pos, i64 t, int h, int c,
                                                      const Chunk& x) {
  const bool is_k = h >= QH;
  if constexpr (Q_NORM == K_NORM) {
    if constexpr (Q_NORM >= 0) return norm_pass_after<Q_NORM>(p, T, max_pos, t, h, c, is_k ? p.k_norm_w : p.q_norm_w, x);
  } else if (is_k) {
    if constexpr (K_NORM >= 0) return norm_pass_after<K_NORM>(p, T, max_pos, t, h, c, p.k_norm_w, x);
  } else {
    if constexpr (Q_NORM >= 0) return norm_pass_after<Q_NORM>(p, T, max_pos, t, h, c, p.q_norm_w, x);
  }
  return x;
}
// ---- end of model families ----------------------------------------------------------------------

// ---- per-token scales (RC_TOKEN_SCALES) ----------------------------------------------------------
// Each (token, kv head) row of the values a cache quantizes gets scale = rc_token_scale(amax) (the
// max of the row's finite |values|, exact in any order), written at the token's slot of the scale
// cache, and the row is quantized with rc_inv_scale(scale). A k row's P rotation lanes reduce their
// amax with xor shuffles (TOKEN_LANES); otherwise (partial rotary, D not a power of two, P > 32)
// each k unit recomputes the whole row's values (L1 hits). V: row units (token, kv head, chunk) in
// every layout, each reading the whole v row for its amax (v_unit_token).

// A row's scale from its amax: r32(max(amax, 1e-8) / Q), Q the cache format's largest value.
__device__ __forceinline__ float row_scale(float amax) {
  if constexpr (LOWB) return rc_low_bit_scale(amax, INT4C != 0);
  return rc_token_scale(amax, FP8_DT);
}

// Element offset of kv head h's scale at cache slot s in the scale caches [.., NB, KH, BS] (head_major:
// [.., KH, NB, BS], s counting the layers' slots one after the other).
__device__ __forceinline__ i64 scale_index(i64 s, int h) {
  if (LAYOUT == RC_HEAD_MAJOR) {
    const i64 layer = s / ((i64)NBL_DIV * BS);
    return (layer * KH + h) * NBL_DIV * BS + (s - layer * NBL_DIV * BS);
  }
  return (s / BS * KH + h) * BS + s % BS;
}

// The xor butterfly's levels over a group's N lanes (a k head's P, a v row's CH): offsets 1, 2, ..
// N/2 (the GPU shuffles and their host emulation take the same levels).
template <int N = P, class F>
__device__ __forceinline__ void over_levels(F&& level) {
#pragma unroll
  for (int off = 1; off < N; off <<= 1) level(off);
}

// The f32 values the key cache quantizes for rotation chunk j of token t's k head h (h >= QH) (NeoX:
// chunks j and j + P into ya, yb), recomputed from the inputs as rot_unit computes them: normalised
// with `inv` (K_NORM), rotated (if `rotate`: RC_USE_ROPE), normalised after the rotation instead
// (RC_NORM_AFTER), rounded to the input dtype unless WIDE_K.
__device__ __forceinline__ void k_rot_values(const Params& p, i64 T, i64 max_pos, i64 t, int h, int j, float inv,
                                             float* ya, float* yb, bool rotate = true) {
  const char* src = rot_src(p, t, h, j);
  Chunk a = load_chunk(src, 0), b = a;
  if (NEOX) b = load_chunk(src, HALF);
  if constexpr (K_NORM >= 0 && !NORM_AFTER) {
    a = norm_chunk<K_NORM>(a, p.k_norm_w, ROFF + j * W, inv);
    if (NEOX) b = norm_chunk<K_NORM>(b, p.k_norm_w, ROFF + HALF + j * W, inv);
  }
  (void)inv;
  if (USE_ROPE && !rotate) {
#pragma unroll
    for (int e = 0; e < W; ++e) ya[e] = to_f32<DT>(a.e[e]);
    if (NEOX) {
#pragma unroll
      for (int e = 0; e < W; ++e) yb[e] = to_f32<DT>(b.e[e]);
    }
    return;
  }
  i64 trows[MROPE ? 3 : 1];
#pragma unroll
  for (int st = 0; st < (MROPE ? 3 : 1); ++st) {
    const i64 r = load_index(p.pos, st * T + t, RC_POS64 != 0);
    trows[st] = (r < 0 ? 0 : (r >= max_pos ? max_pos - 1 : r)) * TW;
  }
  TabVals tv;
  load_chunk_tabs<MROPE != 0>(p.cos, p.sin, trows[0], trows, j, tv);
  rotate_chunk(a, b, tv, ya, yb);
  if constexpr (K_NORM >= 0 && NORM_AFTER) {  // k_out: the rotated row rounded, then normalised
    Chunk oa = norm_chunk<K_NORM>(chunk_from(ya), p.k_norm_w, ROFF + j * W, inv);
#pragma unroll
    for (int e = 0; e < W; ++e) ya[e] = to_f32<DT>(oa.e[e]);
    if (NEOX) {
      Chunk ob = norm_chunk<K_NORM>(chunk_from(yb), p.k_norm_w, ROFF + HALF + j * W, inv);
#pragma unroll
      for (int e = 0; e < W; ++e) yb[e] = to_f32<DT>(ob.e[e]);
    }
  }
  if (!WIDE_K) {  // k_out's rounded values
    const Chunk oa = chunk_from(ya);
#pragma unroll
    for (int e = 0; e < W; ++e) ya[e] = to_f32<DT>(oa.e[e]);
    if (NEOX) {
      const Chunk ob = chunk_from(yb);
#pragma unroll
      for (int e = 0; e < W; ++e) yb[e] = to_f32<DT>(ob.e[e]);
    }
  }
}

// 1/rms of token t's k row (K_NORM), the same bits as the lanes' sum (the spec's tree); RC_NORM_AFTER:
// of the rotated row (a call that does not rotate has no norm).
__device__ __forceinline__ float k_row_inv(const Params& p, i64 T, i64 max_pos, i64 t, int h, bool rotate = true) {
  if constexpr (K_NORM >= 0 && NORM_AFTER) {
    return rotate ? rc_rms_inv(out_row_sq_sum(p, T, max_pos, t, h), D, norm_eps()) : 0.0f;
  }
  if constexpr (K_NORM >= 0) return rc_rms_inv(row_sq_sum(row_src(p, t, h)), D, norm_eps());
  (void)p, (void)T, (void)max_pos, (void)t, (void)h, (void)rotate;
  return 0.0f;
}

// amax of rotation chunk j's values (NeoX: with its partner chunk).
__device__ __forceinline__ float chunk_amax(const float* ya, const float* yb) {
  float m = 0.0f;
#pragma unroll
  for (int e = 0; e < W; ++e) m = rc_amax_step(m, ya[e]);
  if (NEOX) {
#pragma unroll
    for (int e = 0; e < W; ++e) m = rc_amax_step(m, yb[e]);
  }
  return m;
}

// amax of token t's whole k row (k head h >= QH), recomputed by one unit: rotated and pass-through chunks.
__device__ __forceinline__ float k_row_amax(const Params& p, i64 T, i64 max_pos, i64 t, int h, bool rotate = true) {
  const float inv = k_row_inv(p, T, max_pos, t, h, rotate);
  float m = 0.0f;
#pragma unroll 1
  for (int j = 0; j < P; ++j) {
    float ya[W], yb[NEOX ? W : 1];
    k_rot_values(p, T, max_pos, t, h, j, inv, ya, yb, rotate);
    const float c = chunk_amax(ya, yb);
    m = c > m ? c : m;
  }
  const char* row = row_src(p, t, h);
#pragma unroll 1
  for (int c = PASS0; c < PASS0 + CPASS; ++c) {
    Chunk x = load_chunk(row, c * W);
    if constexpr (K_NORM >= 0) {
      if (!NORM_AFTER || rotate) x = norm_chunk<K_NORM>(x, p.k_norm_w, c * W, inv);
    }
#pragma unroll
    for (int e = 0; e < W; ++e) m = rc_amax_step(m, to_f32<DT>(x.e[e]));
  }
  return m;
}

// The k row's amax from rotation unit u, whose own chunk values are m_own's (TOKEN_LANES: the xor
// butterfly over the head's P lanes, paired k units as norm_lanes), else k_row_amax.
__device__ __forceinline__ float k_amax(const Params& p, i64 T, i64 max_pos, i64 t0, int u, float m_own,
                                        bool rotate = true) {
  const RotIdx me = rot_idx(u);
  if constexpr (!TOKEN_LANES) {
    (void)m_own;
    return k_row_amax(p, T, max_pos, t0 + me.tt, me.h, rotate);
  }
#ifdef RC_EMULATE
  // The other lanes rebuilt from the inputs (k_rot_values), this lane's checked against its own.
  emu_check_group(u, KPAIRS != 0);
  const float inv = k_row_inv(p, T, max_pos, t0 + me.tt, me.h, rotate);
  float g[P_DIV];
  for (int i = 0; i < P; ++i) {
    float ya[W], yb[NEOX ? W : 1];
    k_rot_values(p, T, max_pos, t0 + me.tt, me.h, i, inv, ya, yb, rotate);
    g[i] = chunk_amax(ya, yb);
  }
  if (__float_as_uint(g[me.j]) != __float_as_uint(m_own)) ++rc_emu_errors;
  over_levels([&](int off) {
    float n[P_DIV];
    for (int i = 0; i < P; ++i) n[i] = g[i ^ off] > g[i] ? g[i ^ off] : g[i];
    for (int i = 0; i < P; ++i) g[i] = n[i];
  });
  return g[me.j];
#else
  (void)p, (void)T, (void)max_pos, (void)t0, (void)rotate;
  int sh = 0;
  const unsigned int mask = group_mask(KPAIRS != 0, sh);
  float m = m_own;
  over_levels([&](int off) {
    const float o = __shfl_xor_sync(mask, m, off << sh);
    m = o > m ? o : m;
  });
  return m;
#endif
}

// The v row's amax from unit c's own chunk amax m_own (V_LANES): the butterfly over the row's CH lanes.
__device__ __forceinline__ float v_amax_lanes(const char* row, int c, float m_own) {
#ifdef RC_EMULATE
  // The other lanes rebuilt from the row, this lane's checked against its own.
  float g[CH];
  for (int i = 0; i < CH; ++i) {
    const Chunk y = load_chunk(row, i * W);
    g[i] = 0.0f;
    for (int e = 0; e < W; ++e) g[i] = rc_amax_step(g[i], to_f32<DT>(y.e[e]));
  }
  if (__float_as_uint(g[c]) != __float_as_uint(m_own)) ++rc_emu_errors;
  over_levels<CH>([&](int off) {
    float n[CH];
    for (int i = 0; i < CH; ++i) n[i] = g[i ^ off] > g[i] ? g[i ^ off] : g[i];
    for (int i = 0; i < CH; ++i) g[i] = n[i];
  });
  return g[c];
#else
  (void)row, (void)c;
  const unsigned int lane = threadIdx.x & 31u;
  const unsigned int mask = CH >= 32 ? 0xffffffffu : ((1u << (CH & 31)) - 1u) << (lane & ~(unsigned int)(CH - 1));
  float m = m_own;
  over_levels<CH>([&](int off) {
    const float o = __shfl_xor_sync(mask, m, off);
    m = o > m ? o : m;
  });
  return m;
#endif
}

// V row unit (token, kv head, chunk c) of every layout: the row's amax (V_LANES: the row's lanes,
// else from the whole v row, its other chunks L1 hits), the chunk quantized with the row's scale;
// chunk 0 writes the scale.
__device__ __forceinline__ void v_unit_token(const Params& p, i64 T, i64 t0, int u, SlotRange sr) {
  const i64 t = t0 + u / (KH * CH);
  if (t >= T) return;
  const int r = u % (KH * CH), h = r / CH, c = r % CH;
  const char* row = static_cast<const char*>(p.v) + v_row_of(t, h) * S_IN;
  const Chunk x = load_chunk_now(row, c * W);
  const i64 s_raw = load_index_after(p.slots, t, RC_SLOT64 != 0, row);
  const bool ok = s_raw >= 0 && s_raw < sr.n;
  const i64 s = ok ? sr.base + s_raw : 0;
  float m = 0.0f;
  if constexpr (V_LANES) {
#pragma unroll
    for (int e = 0; e < W; ++e) m = rc_amax_step(m, to_f32<DT>(x.e[e]));
    m = v_amax_lanes(row, c, m);
  } else {
#pragma unroll 4
    for (int i = 0; i < CH; ++i) {
      const Chunk y = load_chunk(row, i * W);
#pragma unroll
      for (int e = 0; e < W; ++e) m = rc_amax_step(m, to_f32<DT>(y.e[e]));
    }
  }
  const float scale = row_scale(m), inv = rc_inv_scale(scale);
#if RC_TOKEN_SCALES
  store_if(ok && c == 0, p.v_sc + scale_index(s, h), __float_as_uint(scale));
#endif
  if constexpr (XP && PK4) {  // one byte (two channels) at a time
    const CacheChunk o = int4_chunk(x, inv);
#pragma unroll
    for (int e = 0; e < W / 2; ++e)
      store_if(ok, static_cast<raw_cache*>(p.vc) + value_index(s / BS, s % BS, h, c * W + 2 * e), o.e[e]);
  } else if constexpr (XP) {  // x-packed: the chunk's channels are not adjacent in a value row
#pragma unroll
    for (int e = 0; e < W; ++e)
      store_if(ok, static_cast<raw_cache*>(p.vc) + value_index(s / BS, s % BS, h, c * W + e), to_cache(x.e[e], inv));
  } else {
    store_cache_chunk_if(ok, vcache(p), value_index(s / BS, s % BS, h, c * W), x, inv);
  }
}
// ---- end of per-token scales ----------------------------------------------------------------------

// ---- block formats: NVFP4 and MXFP4 (BLKF) ---------------------------------------------------------
// Block unit (token, k or v, kv head h, block b of GRP channels): the block's values (k: recomputed from
// the inputs as the rotation / pass units compute them, k_rot_values; v: widened), their finite amax,
// the block scale (rope_cache_math.h: rc_nvfp4_scale with the global decode scale, rc_mxfp4_exponent)
// into the block-scale cache, the values times the block's multiplier as E2M1 codes, two a byte. Two
// passes over the block's chunks (amax, then codes; the second's loads are L1 hits): no GRP values
// held in registers.

// The W values of channels d0 .. d0 + W - 1 of token t's k head h (h >= QH) or v head h (is_v).
__device__ __forceinline__ void block_chunk(const Params& p, i64 T, i64 max_pos, i64 t, int h, bool is_v, int d0,
                                            float inv, bool rotate, float* y) {
  if (is_v) {
    const Chunk x = load_chunk(static_cast<const char*>(p.v) + v_row_of(t, h) * S_IN, d0);
#pragma unroll
    for (int e = 0; e < W; ++e) y[e] = to_f32<DT>(x.e[e]);
    return;
  }
  if (R > 0 && d0 >= ROFF && d0 < ROFF + R) {
    const int r = d0 - ROFF;
    const bool second = NEOX && r >= HALF;
    float ya[W], yb[NEOX ? W : 1];
    (void)yb;
    k_rot_values(p, T, max_pos, t, QH + h, (second ? r - HALF : r) / W, inv, ya, yb, rotate);
#pragma unroll
    for (int e = 0; e < W; ++e) y[e] = NEOX && second ? yb[e] : ya[e];
    return;
  }
  Chunk x = load_chunk(row_src(p, t, QH + h), d0);
  if constexpr (K_NORM >= 0) {
    if (!NORM_AFTER || rotate) x = norm_chunk<K_NORM>(x, p.k_norm_w, d0, inv);
  }
#pragma unroll
  for (int e = 0; e < W; ++e) y[e] = to_f32<DT>(x.e[e]);
}

__device__ __forceinline__ void block_unit(const Params& p, i64 T, i64 max_pos, i64 t0, int u, SlotRange sr) {
  constexpr int NBK = D / GRP;  // blocks per row
  const i64 t = t0 + u / (2 * KH * NBK);
  if (t >= T) return;
  const int r = u % (2 * KH * NBK), h = (r / NBK) % KH, b = r % NBK;
  const bool is_v = r >= KH * NBK;
  const i64 s_raw = load_index(p.slots, t, RC_SLOT64 != 0);
  if (s_raw < 0 || s_raw >= sr.n) return;
  const i64 s = sr.base + s_raw, blk = s / BS, off = s % BS;
  const bool rotate = R > 0 && rope_on(p);
  const float inv = is_v ? 0.0f : k_row_inv(p, T, max_pos, t, QH + h, rotate);
  float amax = 0.0f;
#pragma unroll 1
  for (int i = 0; i < GRP / W; ++i) {
    float y[W];
    block_chunk(p, T, max_pos, t, h, is_v, b * GRP + i * W, inv, rotate, y);
#pragma unroll
    for (int e = 0; e < W; ++e) amax = rc_amax_step(amax, y[e]);
  }
  rc_u8 sb;
  float mult;
#if RC_CACHE_DT == 8
  const float g = *(is_v ? p.v_g : p.k_g);
  sb = rc_nvfp4_scale(amax, rc_inv_scale(g));
  mult = rc_nvfp4_multiplier(sb, g);
#else
  const rc_i32 x = rc_mxfp4_exponent(amax);
  sb = (rc_u8)(x + 127);
  mult = rc_mxfp4_multiplier(x);
#endif
#if RC_TOKEN_SCALES
  reinterpret_cast<unsigned char*>(is_v ? p.v_sc : p.k_sc)[key_index_bytes<NBK>(blk, off, h, b)] = sb;
#endif
  char* cache = static_cast<char*>(is_v ? vcache(p) : p.kc) + key_index_bytes<D / 2>(blk, off, h, b * GRP / 2);
#pragma unroll 1
  for (int i = 0; i < GRP / W; ++i) {
    float y[W];
    block_chunk(p, T, max_pos, t, h, is_v, b * GRP + i * W, inv, rotate, y);
    CacheChunk o;
#pragma unroll
    for (int e = 0; e < W / 2; ++e)
      o.e[e] = rc_pack_int4(rc_e2m1_code(rc_mul(y[2 * e], mult)), rc_e2m1_code(rc_mul(y[2 * e + 1], mult)));
    *reinterpret_cast<decltype(o.v)*>(cache + i * (W / 2)) = o.v;
  }
}
// ---- end of block formats -------------------------------------------------------------------------

// mr, share (RC_MROW): the block's merged rows, and whether this thread still has its share to do.
__device__ __forceinline__ void rot_unit(const Params& p, i64 T, i64 max_pos, i64 t0, int u, SlotRange sr,
                                         float inv_k, MRows* mr, bool& share) {
  const RotIdx ix = rot_idx(u);
  const int h = ix.h, j = ix.j;
  const i64 t = t0 + ix.tt;
  if (t >= T) return;  // the whole head (all P lanes) returns: shuffle groups stay whole
  const bool is_k = h >= QH;
  const i64 row = row_of(t, h);
  const char* src = rot_src(p, t, h, j);
  // Independent loads first: the inputs, then the position and the slot (issued after them).
  Chunk a = load_chunk(src, 0);
  Chunk b;
  if (NEOX) b = load_chunk(src, HALF);
  WeightChunks ew{};
  if constexpr (EARLY_W) {
    if (is_k ? K_NORM >= 0 : Q_NORM >= 0) {  // a tensor without a norm has a placeholder weight
      const void* wp = is_k ? p.k_norm_w : p.q_norm_w;
      ew.a = load_chunk(wp, ROFF + j * W);
      if (NEOX) ew.b = load_chunk(wp, ROFF + HALF + j * W);
    }
  }
  const bool rotate = rope_on(p);  // RC_USE_ROPE: this call's switch, else true
  i64 pclamp = 0;                  // RC_TEMP_FS: the clamped position
  (void)pclamp;
  // The cos/sin row: table row `position`, or (RC_MROW) the token's merged row in shared memory.
  i64 trow, trows[MROPE && !MROW ? 3 : 1];  // M-RoPE: the row of each stream (stream 0 is `trow`)
  if constexpr (MROW) {
    trow = (i64)ix.tt * TW;
  } else {
    i64 prow = load_index_after(p.pos, t, RC_POS64 != 0, src);
    prow = prow < 0 ? 0 : (prow >= max_pos ? max_pos - 1 : prow);
    trow = trows[0] = prow * TW;
    if constexpr (TEMP_FS > 0) pclamp = prow;
  }
  if constexpr (MROPE != 0 && !MROW) {
#pragma unroll
    for (int st = 1; st < 3; ++st) {
      i64 r = load_index_after(p.pos, st * T + t, RC_POS64 != 0, src);
      r = r < 0 ? 0 : (r >= max_pos ? max_pos - 1 : r);
      trows[st] = r * TW;
    }
  }
  const i64 s_raw = load_index_after(p.slots, t, RC_SLOT64 != 0, src);  // q heads too: no branch
  const i64 s_any = (s_raw >= 0 && s_raw < sr.n) ? sr.base + s_raw : -1;
  if constexpr (KS_HEADS) inv_k = head_inv(p.k_scale, is_k ? h - QH : 0, inv_k, true);
  if constexpr (MROW) {  // the loads above are in flight: this thread's share of the rows, if still due
    if (share) mrow_share(p, T, max_pos, t0, mr), share = false;
  }
  // The table values of this chunk (the one dependent load), then the arithmetic.
  const void* const tcos = MROW ? static_cast<const void*>(mr->cos) : p.cos;
  const void* const tsin = MROW ? static_cast<const void*>(mr->sin) : p.sin;
  const int c0 = NEOX ? j * W : (FULL ? j * W : j * W / 2);
  Chunk oa, ob;
  float ya[W], yb[NEOX ? W : 1];  // the rotated f32 values (WIDE_K: quantized from these)
  (void)yb;
  if (USE_ROPE && !rotate) {  // no rotation: the (normalised) inputs; q scaled by the temperature
    if constexpr (NORM && !NORM_AFTER) norm_rot_unit(p, t0, u, is_k, src, j, a, b, ew);
    if constexpr (TEMP_FS > 0) {
      if (!is_k) {
        const float f = temp_factor(p, pclamp);
        a = scale_chunk(a, f);
        if (NEOX) b = scale_chunk(b, f);
      }
    }
    oa = a, ob = b;
#pragma unroll
    for (int e = 0; e < W; ++e) ya[e] = to_f32<DT>(a.e[e]);
    if (NEOX) {
#pragma unroll
      for (int e = 0; e < W; ++e) yb[e] = to_f32<DT>(b.e[e]);
    }
  } else if (PACKED_NATIVE) {
    const TabWords c = load_words(tcos, trow + c0), sn = load_words(tsin, trow + c0);
    TabWords c2 = c, s2 = sn;
    if (FULL) {
      c2 = load_words(tcos, trow + HALF + j * W);
      s2 = load_words(tsin, trow + HALF + j * W);
    }
    if constexpr (NORM && !NORM_AFTER) norm_rot_unit(p, t0, u, is_k, src, j, a, b, ew);  // while the table row is in flight
    rot_native_packed(a, b, c, sn, c2, s2, oa, ob);
  } else {
    TabVals tv;
    load_chunk_tabs<MROPE != 0 && !MROW>(tcos, tsin, trow, trows, j, tv);
    if constexpr (NORM && !NORM_AFTER) norm_rot_unit(p, t0, u, is_k, src, j, a, b, ew);  // while the table row is in flight
    rotate_chunk(a, b, tv, ya, yb);
    oa = chunk_from(ya);
    if (NEOX) ob = chunk_from(yb);
  }
  if constexpr (NORM_AFTER) {  // the rotated, rounded chunks normalised (the head's lanes all rotate or not)
    if (rotate) norm_after_unit(p, T, max_pos, t0, u, is_k, j, oa, ob, ew);
  }
  if constexpr (TOKEN && !BLKF) {
    if (is_k) {  // the row's scale (all P lanes of the head take this branch together)
      float own = 0.0f;
      if constexpr (TOKEN_LANES) {
        float va[W], vb[NEOX ? W : 1];
#pragma unroll
        for (int e = 0; e < W; ++e) va[e] = WIDE_K ? ya[e] : to_f32<DT>(oa.e[e]);
        if (NEOX) {
#pragma unroll
          for (int e = 0; e < W; ++e) vb[e] = WIDE_K ? yb[e] : to_f32<DT>(ob.e[e]);
        }
        own = chunk_amax(va, vb);
      }
      const float scale = row_scale(k_amax(p, T, max_pos, t0, u, own, rotate));
      inv_k = rc_inv_scale(scale);
#if RC_TOKEN_SCALES
      if (j == 0 && s_any >= 0) p.k_sc[scale_index(s_any, h - QH)] = scale;
#endif
    }
  }
  void* dst = is_k ? p.k_out : p.q_out;
  store_chunk(dst, row + ROFF + j * W, oa);
  if (NEOX) store_chunk(dst, row + ROFF + HALF + j * W, ob);
  const i64 s = is_k && !BLKF ? s_any : -1;  // BLKF: the block units write the caches
  if (s >= 0) {
    const i64 blk = s / BS, off = s % BS;
    const int kh = h - QH;
    if constexpr (KW < W) {  // RC_X below the chunk: one store per X group
      auto at = [&](int d0) { return [=](int e) { return key_index(blk, off, kh, d0 + e); }; };
      if (WIDE_K) {
        store_key_chunk_f32(p.kc, at(ROFF + j * W), ya, inv_k);
        if (NEOX) store_key_chunk_f32(p.kc, at(ROFF + HALF + j * W), yb, inv_k);
      } else {
        store_key_chunk(p.kc, at(ROFF + j * W), oa, inv_k);
        if (NEOX) store_key_chunk(p.kc, at(ROFF + HALF + j * W), ob, inv_k);
      }
    } else if (WIDE_K) {  // never PACKED_NATIVE ("rounded"), so ya/yb hold the values
      store_cache_chunk_f32(p.kc, key_index(blk, off, kh, ROFF + j * W), ya, inv_k);
      if (NEOX) store_cache_chunk_f32(p.kc, key_index(blk, off, kh, ROFF + HALF + j * W), yb, inv_k);
    } else {
      store_cache_chunk(p.kc, key_index(blk, off, kh, ROFF + j * W), oa, inv_k);
      if (NEOX) store_cache_chunk(p.kc, key_index(blk, off, kh, ROFF + HALF + j * W), ob, inv_k);
    }
  }
}

// Channels >= R of one q/k head: copied to q_out/k_out (and the key cache).
__device__ __forceinline__ void pass_unit(const Params& p, i64 T, i64 max_pos, i64 t0, int u, SlotRange sr,
                                          float inv_k) {
  constexpr int CP = CPASS > 0 ? CPASS : 1;
  const i64 t = t0 + u / (RH * CP);
  if (t >= T) return;
  const int r = u % (RH * CP), h = r / CP, c = PASS0 + r % CP;
  const bool is_k = h >= QH;
  const i64 row = row_of(t, h);
  const char* src = static_cast<const char*>(is_k ? p.k : p.q) + (in_row_of(t, h) + c * W) * S_IN;
  Chunk x = load_chunk_now(src, 0);
  const i64 s_raw = load_index_after(p.slots, t, RC_SLOT64 != 0, src);
  const bool ok = is_k && s_raw >= 0 && s_raw < sr.n;
  const i64 s = ok ? sr.base + s_raw : 0;
  const bool rotate = R > 0 && rope_on(p);  // this call rotates (its rotary channels)
  (void)rotate;
  if constexpr (NORM && !NORM_AFTER) x = norm_pass_unit(p, is_k, src - c * W * S_IN, c, x);
  if constexpr (NORM && NORM_AFTER) {
    if (rotate) x = norm_pass_after_unit(p, T, max_pos, t, h, c, x);
  }
  if constexpr (TEMP_FS > 0) {  // a call that does not rotate: q times its token's factor
    if (!rotate && !is_k) x = scale_chunk(x, temp_factor(p, clamped_pos(p, max_pos, t)));
  }
  if constexpr (KS_HEADS) inv_k = head_inv(p.k_scale, is_k ? h - QH : 0, inv_k, true);
  if constexpr (BLKF) return (void)store_chunk(is_k ? p.k_out : p.q_out, row + c * W, x);  // caches: block units
  if constexpr (TOKEN) {  // R < D: never TOKEN_LANES; the rotation unit of chunk 0 writes the scale
    if (is_k) {
      const float scale = row_scale(k_row_amax(p, T, max_pos, t, h, rotate));
      inv_k = rc_inv_scale(scale);
#if RC_TOKEN_SCALES
      if constexpr (P == 0) {  // NoPE: no rotation unit, pass chunk 0 writes it
        if (ok && c == 0) p.k_sc[scale_index(s, h - QH)] = scale;
      }
#endif
    }
  }
  (void)max_pos;
  store_chunk(is_k ? p.k_out : p.q_out, row + c * W, x);
  if constexpr (KW < W) {
    const int kh = is_k ? h - QH : 0;
    store_key_chunk(p.kc, [=](int e) { return key_index(s / BS, s % BS, kh, c * W + e); }, x, inv_k, ok);
  } else {
    store_cache_chunk_if(ok, p.kc, key_index(s / BS, s % BS, is_k ? h - QH : 0, c * W), x, inv_k);
  }
}

// Flash V: one chunk of v into the value cache.
__device__ __forceinline__ void v_unit_flash(const Params& p, i64 T, i64 t0, int u, SlotRange sr, float inv_v) {
  const i64 t = t0 + u / (KH * CH);
  if (t >= T) return;
  const int r = u % (KH * CH), h = r / CH, c = r % CH;
  const char* src = static_cast<const char*>(p.v) + (v_row_of(t, h) + c * W) * S_IN;
  const Chunk x = load_chunk_now(src, 0);  // in bounds whatever the slot
  const i64 s_raw = load_index_after(p.slots, t, RC_SLOT64 != 0, src);
  const bool ok = s_raw >= 0 && s_raw < sr.n;
  if constexpr (VS_HEADS) inv_v = head_inv(p.v_scale, h, inv_v, true);
  const i64 s = ok ? sr.base + s_raw : 0;
  store_cache_chunk_if(ok, vcache(p), value_index(s / BS, s % BS, h, c * W), x, inv_v);
}

// x-packed V unit u -> (group g of VG tokens, kv head h, channel group c of VCH channels), c
// fastest. With RC_VPAIRS (XPACKED, two or more pieces per value row), lanes pair up (groups 2k,
// 2k + 1: offsets 0..X-1 and X..2X-1 of a block in a run), so that one warp store fills whole
// 32-byte sectors.
#ifdef RC_EMULATE
static long long rc_emu_pieces = 0;  // run pieces stored (the tests count the runs in the slots)
#endif
constexpr bool V_PAIRS = RC_VPAIRS && V_RUNS && LAYOUT == RC_XPACKED && BS / X >= 2 && (TPB / VG) % 2 == 0;

struct VIdx {
  int g, h, c;
};
template <int NC = DC>  // channel groups per kv head
__device__ __forceinline__ VIdx v_idx(int u) {
  VIdx ix;
  if (V_PAIRS) {
    const int half = u % 2, r = u / 2;
    ix.c = r % NC;
    ix.h = (r / NC) % KH;
    ix.g = (r / (NC * KH)) * 2 + half;
  } else {
    ix.g = u / (KH * NC);
    const int r = u % (KH * NC);
    ix.h = r / NC;
    ix.c = r % NC;
  }
  return ix;
}

// x-packed V: channel d of kv head h for the VG tokens of group g (RC_VCH 1).
__device__ __forceinline__ void v_unit_xpacked(const Params& p, i64 T, i64 t0, int u, SlotRange sr, float inv_v) {
  const VIdx ix = v_idx(u);
  const int g = ix.g, h = ix.h, d = ix.c;
  const i64 tg = t0 + (i64)g * VG;
  if (tg >= T) return;
  if constexpr (VS_HEADS) inv_v = head_inv(p.v_scale, h, inv_v, true);
  raw_in x[VG];
  // The group is a run if its slots are s0, s0 + 1, ... (s0 valid, a multiple of X); only s0 and a
  // flag stay live (registers), the other path reads its slots again (L1 hits).
  const i64 s0 = valid_slot(p, tg, sr);
  bool run = V_RUNS && s0 >= 0 && s0 % X == 0 && tg + VG <= T;
#pragma unroll
  for (int i = 0; i < VG; ++i) {
    const bool in = tg + i < T;
    x[i] = in ? load_elem_now(p.v, v_row_of(tg + i, h) + d) : (raw_in)0;
    if (i > 0) run = run && in && valid_slot(p, tg + i, sr) == s0 + i;
  }
  if (run) {  // one aligned piece of X consecutive offsets of one value row
    CachePiece o;
#pragma unroll
    for (int i = 0; i < (X_FITS ? X : 1); ++i) o.e[i] = to_cache(x[i % VG], inv_v);
    *reinterpret_cast<decltype(o.v)*>(static_cast<raw_cache*>(p.vc) + value_index(s0 / BS, s0 % BS, h, d)) = o.v;
#ifdef RC_EMULATE
    ++rc_emu_pieces;
#endif
  } else {
#pragma unroll
    for (int i = 0; i < VG; ++i) {
      const i64 si = tg + i < T ? valid_slot(p, tg + i, sr) : -1;
      const i64 sc = si >= 0 ? si : 0;
      store_if(si >= 0, static_cast<raw_cache*>(p.vc) + value_index(sc / BS, sc % BS, h, d), to_cache(x[i], inv_v));
    }
  }
}

// ---- x-packed V of VCH channels (RC_VCH > 1) ------------------------------------------------------
// One token's VCH channels: one load of VCH * S_IN bytes (4..16).
constexpr int vcb(int c) { return c > 1 ? c * S_IN : 4; }
template <int C>
union VChansT {
  typename VecOf<vcb(C)>::T v;
  unsigned int w[vcb(C) / 4];
  raw_in e[vcb(C) / S_IN];
};
constexpr int VCB = vcb(VCH);
using VChans = VChansT<VCH>;

// The cache slot base + s0 of token tg if the slots of tokens tg .. tg + VG - 1 (all < T) are one
// aligned run s0 + i (0 <= s0, s0 + VG <= n, (base + s0) % X == 0), else -1. The slots are read 16
// bytes at a time where the address allows (tg is a multiple of VG, so only the buffer's own
// alignment decides), else one by one.
__device__ __forceinline__ i64 run_slot(const Params& p, i64 tg, SlotRange sr) {
  constexpr int SS = RC_SLOT64 ? 8 : 4, PER = 16 / SS;  // V_RUNS: VG * SS is a multiple of 16
  const char* a = static_cast<const char*>(p.slots) + tg * SS;
  union {
    uint4 v;
    int s32[4];
    i64 s64[2];
  } sv;
  i64 s0 = 0;
  bool seq = true;
  // s_i - s0 == i in the slot's own width (wrapping) is exact for an s0 that passes the final
  // checks: int64: s0 + i < n; int32: s0 % X == 0 (base % X == 0) keeps s0 + i < 2^31.
  const bool vec = (reinterpret_cast<unsigned long long>(a) & 15u) == 0;
#pragma unroll
  for (int k = 0; k < VG / PER; ++k) {
    if (vec) {
      sv.v = *reinterpret_cast<const uint4*>(a + 16 * k);
    } else {
#pragma unroll
      for (int e = 0; e < PER; ++e) {
        if (SS == 8) sv.s64[e] = static_cast<const i64*>(p.slots)[tg + k * PER + e];
        else sv.s32[e] = static_cast<const int*>(p.slots)[tg + k * PER + e];
      }
    }
#pragma unroll
    for (int e = 0; e < PER; ++e) {
      const int i = k * PER + e;
      const i64 s = SS == 8 ? sv.s64[e] : (i64)sv.s32[e];
      if (i == 0) {
        s0 = s;
      } else if (SS == 8) {
        seq = seq && (unsigned long long)s - (unsigned long long)s0 == (unsigned long long)i;
      } else {
        seq = seq && (unsigned int)sv.s32[e] - (unsigned int)s0 == (unsigned int)i;
      }
    }
  }
  return seq && s0 >= 0 && s0 < sr.n - (VG - 1) && (sr.base + s0) % X == 0 ? sr.base + s0 : -1;
}

// Word m of the cache piece of channel c: that channel of tokens m * (4 / S_CACHE) .. in order.
template <int C>
__device__ __forceinline__ unsigned int piece_word(const VChansT<C>* x, int c, int m, float inv_v) {
  if constexpr (FP8) {  // four tokens, quantized
    unsigned int r = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b) r |= (unsigned int)to_cache(x[4 * m + b].e[c], inv_v) << (8 * b);
    return r;
  } else if constexpr (S_IN == 2) {  // tokens 2m, 2m + 1: the same half of their word c / 2
    return __byte_perm(x[2 * m].w[c / 2], x[2 * m + 1].w[c / 2], c % 2 ? 0x7632 : 0x5410);
  } else {
    return x[m].w[c];
  }
}

// One 16-byte store (a plain store of a piece built word by word is split into four by NVVM).
__device__ __forceinline__ void store16(void* addr, uint4 v) {
#ifdef __CUDA_ARCH__
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
#else
  if (reinterpret_cast<unsigned long long>(addr) % 16) ++rc_emu_errors;  // the GPU would fault
  ++rc_emu_pieces;
  *static_cast<uint4*>(addr) = v;
#endif
}

// Elements between the value rows of channels d and d + 1 (value_index).
constexpr int V_ROW = LAYOUT == RC_XPACKED ? BS : X;

// An aligned run of VG tokens starting at cache slot s0: channels d0 .. d0 + C - 1 of kv head h
// (x[i]: token i's channels) as C 16-byte pieces, one per channel row, transposed in registers.
template <int C>
__device__ __forceinline__ void store_run(const Params& p, const VChansT<C>* x, i64 s0, int h, int d0, float inv_v) {
  raw_cache* vc = static_cast<raw_cache*>(p.vc) + value_index(s0 / BS, s0 % BS, h, d0);
#pragma unroll
  for (int c = 0; c < C; ++c) {
    union {
      uint4 v;
      unsigned int w[4];
    } o;
#pragma unroll
    for (int m = 0; m < 4; ++m) o.w[m] = piece_word<C>(x, c, m, inv_v);
    store16(vc + c * V_ROW, o.v);
  }
}

// x-packed V: channels d0 .. d0 + VCH - 1 of kv head h for the VG tokens of group g. Each token's
// channels are one load; a run (V_RUNS, all VG tokens < T, aligned consecutive slots) becomes VCH
// pieces of 16 bytes (one per channel row, transposed in registers); any other group is written
// element by element as in v_unit_xpacked.
__device__ __forceinline__ void v_unit_xpacked_vec(const Params& p, i64 T, i64 t0, int u, SlotRange sr,
                                                   float inv_v) {
  const VIdx ix = v_idx(u);
  const int h = ix.h, d0 = ix.c * VCH;
  const i64 tg = t0 + (i64)ix.g * VG;
  if (tg >= T) return;
  if constexpr (VS_HEADS) inv_v = head_inv(p.v_scale, h, inv_v, true);
  const raw_in* src = static_cast<const raw_in*>(p.v) + v_row_of(tg, h) + d0;
  VChans x[VG];
#pragma unroll
  for (int i = 0; i < VG; ++i) {
    x[i].v = VecOf<VCB>::T{};
    if (tg + i < T) x[i].v = load_now<VecOf<VCB>::T>(src + i * IN_KVROW);
  }
  raw_cache* vc = static_cast<raw_cache*>(p.vc);
  if constexpr (V_RUNS) {
    const i64 s0 = tg + VG <= T ? run_slot(p, tg, sr) : -1;
    if (s0 >= 0) {
      store_run<VCH>(p, x, s0, h, d0, inv_v);
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < VG; ++i) {
    const i64 si = tg + i < T ? valid_slot(p, tg + i, sr) : -1;
    const i64 sc = si >= 0 ? si : 0;
    raw_cache* dst = vc + value_index(sc / BS, sc % BS, h, d0);
#pragma unroll
    for (int c = 0; c < VCH; ++c) store_if(si >= 0, dst + c * V_ROW, to_cache(x[i].e[c], inv_v));
  }
}
// ---- end of x-packed V of VCH channels ------------------------------------------------------------

// ---- RC_VSEL: the V decomposition chosen per block --------------------------------------------------
#ifdef RC_EMULATE
static long long rc_emu_run_units = 0;  // v_unit_run units done (the tests count the all-run blocks)
// The units one block's parts (RC_SPLIT) did: their count and index sum, checked after the block.
static long long rc_emu_block_units = 0, rc_emu_block_sum = 0, rc_emu_block_n = 0;
#endif
// Every thread of the block computes the same answer from the block's slots: all TPB tokens < T and
// every group of X tokens an aligned run inside the slot range (run_slot: 16-byte slot loads where
// the buffer is 16-byte aligned, else one by one). No shared memory, no barrier.
__device__ __forceinline__ bool block_runs(const Params& p, i64 T, i64 t0, SlotRange sr) {
  if (t0 + TPB > T) return false;
  bool all = true;
#pragma unroll
  for (int g = 0; g < TPB / X; ++g) all = all & (run_slot(p, t0 + (i64)g * X, sr) >= 0);
  return all;
}

// A V unit of an all-run block (block_runs): channels d0 .. d0 + C - 1 of kv head h for the X tokens
// of group g, written as C 16-byte pieces (as v_unit_xpacked_vec's run path); the group's run starts
// at its first token's slot.
template <int C>
__device__ __forceinline__ void v_unit_run(const Params& p, i64 t0, int u, SlotRange sr, float inv_v) {
  const VIdx ix = v_idx<D / C>(u);
  const int h = ix.h, d0 = ix.c * C;
  const i64 tg = t0 + (i64)ix.g * VG;
  if constexpr (VS_HEADS) inv_v = head_inv(p.v_scale, h, inv_v, true);
  const raw_in* src = static_cast<const raw_in*>(p.v) + v_row_of(tg, h) + d0;
  VChansT<C> x[VG];
#pragma unroll
  for (int i = 0; i < VG; ++i) x[i].v = load_now<typename VecOf<vcb(C)>::T>(src + i * IN_KVROW);
  const i64 s0 = sr.base + load_index(p.slots, tg, RC_SLOT64 != 0);
#ifdef RC_EMULATE
  if (run_slot(p, tg, sr) != s0) ++rc_emu_errors;  // the block's decision said: an aligned run
  ++rc_emu_run_units;
#endif
  store_run<C>(p, x, s0, h, d0, inv_v);
}

// One block's work. T: tokens, n_lead: the caches' leading dimension (NB, or L when stacked),
// max_pos: rows of the tables; the launcher's entry reads them from the parameter block, the
// kernel-node entry has them as compile-time constants.
__device__ __forceinline__ void run_block(const Params& p, const i64 T, const i64 n_lead, const i64 max_pos) {
  const i64 t0 = (i64)blockIdx.x * TPB;
  SlotRange sr{(NBL > 0 ? (i64)NBL : n_lead) * BS, 0};  // head_major: n_lead is KH (unstacked)
  if (LAYER_BLOCKS > 0) {  // stacked [L, NB, ...]: a layer outside [0, L) writes nothing
    const i64 layer = *p.layer, per_layer = (i64)LAYER_BLOCKS * BS;
    sr = (layer >= 0 && layer < n_lead) ? SlotRange{per_layer, layer * per_layer} : SlotRange{0, 0};
  }
  // per head or per token: in the units
  const float inv_k = FP8 && !KS_HEADS && !TOKEN ? rc_inv_scale(*p.k_scale) : 1.0f;
  const float inv_v = FP8 && !VS_HEADS && !TOKEN ? rc_inv_scale(*p.v_scale) : 1.0f;
  // RC_VSEL: the block's V decomposition (the same in every thread).
  bool vrun = false;
  if constexpr (VSEL > 0) vrun = block_runs(p, T, t0, sr);
  const int n_units = VSEL > 0 ? N_ROT + N_PASS + (vrun ? N_V_RUN : N_V) : N_UNITS;
  // Units tid, tid + NT, ... (RC_SPLIT: part y from y * NT, stride NT * SPLIT; a part boundary is a
  // multiple of NT, so a head's norm lanes stay in one warp): rotation, then pass-through, then V.
  const int u0 = SPLIT > 1 ? (int)blockIdx.y * NT : 0;
  // RC_MROW: this thread's share of the merged rows, in its first rotation unit (after that unit's
  // loads), else now; a thread whose rotation units all lie past T does it after its units.
  MRows* mr = nullptr;
  bool share = MROW;
  if constexpr (MROW) {
#ifdef RC_EMULATE
    mr = &rc_emu_rows;
#else
    __shared__ MRows rows;
    mr = &rows;
#endif
    if (u0 + (int)threadIdx.x >= N_ROT) mrow_share(p, T, max_pos, t0, mr), share = false;
  }
#pragma unroll 1
  for (int u = u0 + (int)threadIdx.x; u < n_units; u += NT * SPLIT) {
#ifdef RC_EMULATE
    ++rc_emu_block_units, rc_emu_block_sum += u, rc_emu_block_n = n_units;
#endif
    if (u < N_ROT) {
      rot_unit(p, T, max_pos, t0, u, sr, inv_k, mr, share);
    } else if (u < N_ROT + N_PASS) {
      pass_unit(p, T, max_pos, t0, u - N_ROT, sr, inv_k);
    } else if (BLKF) {
      block_unit(p, T, max_pos, t0, u - V0, sr);
    } else if (TOKEN) {
      if (u >= V0) v_unit_token(p, T, t0, u - V0, sr);  // below V0: padding, idle
    } else if (XP) {
      if constexpr (VCH > 1) {
        v_unit_xpacked_vec(p, T, t0, u - N_ROT - N_PASS, sr, inv_v);
      } else if constexpr (VSEL > 0) {
        if (vrun) v_unit_run<VSEL>(p, t0, u - N_ROT - N_PASS, sr, inv_v);
        else v_unit_xpacked(p, T, t0, u - N_ROT - N_PASS, sr, inv_v);
      } else {
        v_unit_xpacked(p, T, t0, u - N_ROT - N_PASS, sr, inv_v);
      }
    } else {
      v_unit_flash(p, T, t0, u - N_ROT - N_PASS, sr, inv_v);
    }
  }
  if constexpr (MROW) {
    if (share) mrow_share(p, T, max_pos, t0, mr);
  }
}
}  // namespace rc

#ifndef RC_NODE
// The launcher's entry: one parameter block (see "Kernel ABI" above).
extern "C" __global__ void __launch_bounds__(RC_NT, RC_MINB) rope_cache_kernel(const rc::Params p) {
#if RC_TOKEN_SCALES  // a slot is written only where the caches and both scale caches hold it
  const rc::i64 lead = p.dim0[3] < p.dim0[9] ? p.dim0[3] : p.dim0[9];
  rc::run_block(p, p.dim0[0], lead < p.dim0[10] ? lead : p.dim0[10], p.dim0[7]);
#else
  rc::run_block(p, p.dim0[0], p.dim0[3], p.dim0[7]);
#endif
}
#else
// The kernel-node entry (XLA's PTX custom call, backends/kernel_node.py): one pointer parameter per
// buffer, the 14 operands then the 4 results (6 with RC_TOKEN_SCALES) in custom-call order (the
// aliased caches appear twice, as operand and as result: the same address); T, the caches' leading
// dimension and the table rows are the call's static shapes, compiled in (RC_NODE_T, RC_NODE_LEAD,
// RC_NODE_MAX_POS).
#if !defined(RC_NODE_T) || !defined(RC_NODE_LEAD) || !defined(RC_NODE_MAX_POS)
#error "RC_NODE needs RC_NODE_T, RC_NODE_LEAD and RC_NODE_MAX_POS"
#endif
extern "C" __global__ void __launch_bounds__(RC_NT, RC_MINB) rope_cache_node(
    const void* q, const void* k, const void* v, const void* key_cache, const void* value_cache, const void* slots,
    const void* pos, const void* cos, const void* sin, const float* k_scale, const float* v_scale, const int* layer,
    const void* q_norm_w, const void* k_norm_w,
#if RC_USE_ROPE
    const int* use_rope,  // the extra operands (contract.extra_operands), after the 14
#endif
#if RC_TEMP_FS
    const float* temp,
#endif
#if RC_CACHE_DT == 8
    const float* k_g, const float* v_g,
#endif
    void* q_out, void* k_out, void* kc, void* vc
#if RC_TOKEN_SCALES
    , float* k_sc, float* v_sc  // the scale-cache results (aliased: the k_scale / v_scale addresses)
#endif
) {
#if RC_USE_ROPE || RC_TEMP_FS || RC_CACHE_DT == 8
  rc::Params p{};
  p.q = q, p.k = k, p.v = v, p.key_cache_in = key_cache, p.value_cache_in = value_cache, p.slots = slots;
  p.pos = pos, p.cos = cos, p.sin = sin, p.k_scale = k_scale, p.v_scale = v_scale, p.layer = layer;
  p.q_norm_w = q_norm_w, p.k_norm_w = k_norm_w, p.q_out = q_out, p.k_out = k_out, p.kc = kc, p.vc = vc;
#if RC_USE_ROPE
  p.use_rope = use_rope;
#endif
#if RC_TEMP_FS
  p.temp = temp;
#endif
#if RC_CACHE_DT == 8
  p.k_g = k_g, p.v_g = v_g;
#endif
#if RC_TOKEN_SCALES
  p.k_sc = k_sc, p.v_sc = v_sc;
#endif
#elif RC_TOKEN_SCALES
  const rc::Params p{q, k, v, key_cache, value_cache, slots, pos, cos, sin, k_scale, v_scale, layer, q_norm_w,
                     k_norm_w, q_out, k_out, kc, vc, k_sc, v_sc, {}};
#else
  const rc::Params p{q, k, v, key_cache, value_cache, slots, pos, cos, sin, k_scale, v_scale, layer, q_norm_w,
                     k_norm_w, q_out, k_out, kc, vc, {}};
#endif
  rc::i64 t = RC_NODE_T, lead = RC_NODE_LEAD, max_pos = RC_NODE_MAX_POS;
#if defined(__CUDA_ARCH__) && !RC_NODE_FOLD_DIMS
  // Opaque to the optimizer, as the launcher's entry reads them at run time: folded in, the same
  // kernel ran 1.7-1.8% slower at T >= 8192 (benchmarks/diagnostics/node_codegen.py).
  asm("mov.b64 %0, %0;" : "+l"(t));
  asm("mov.b64 %0, %0;" : "+l"(lead));
  asm("mov.b64 %0, %0;" : "+l"(max_pos));
#endif
  rc::run_block(p, t, lead, max_pos);
}
#endif

#ifdef RC_EMULATE
// Runs the whole grid on the host, block after block (each block's RC_SPLIT parts in turn);
// returns the emulation's failed checks.
extern "C" int rc_emulate(const rc::Params* p, long long grid) {
  rc::rc_emu_errors = 0;
  rc::rc_emu_pieces = 0;
  rc::rc_emu_run_units = 0;
  for (long long b = 0; b < grid; ++b) {
    rc::rc_emu_block_units = rc::rc_emu_block_sum = 0;
    for (int y = 0; y < rc::SPLIT; ++y) {
      blockIdx.x = (unsigned)b, blockIdx.y = (unsigned)y;
      threadIdx.x = 0;
#ifndef RC_NODE
      rope_cache_kernel(*p);
#else  // the kernel-node entry, its pointers in custom-call order (the dims are its constants)
      const rc::Params& w = *p;
      rope_cache_node(w.q, w.k, w.v, w.key_cache_in, w.value_cache_in, w.slots, w.pos, w.cos, w.sin, w.k_scale,
                      w.v_scale, w.layer, w.q_norm_w, w.k_norm_w,
#if RC_USE_ROPE
                      w.use_rope,
#endif
#if RC_TEMP_FS
                      w.temp,
#endif
#if RC_CACHE_DT == 8
                      w.k_g, w.v_g,
#endif
                      w.q_out, w.k_out, w.kc, w.vc
#if RC_TOKEN_SCALES
                      , w.k_sc, w.v_sc
#endif
      );
#endif
    }
    // every unit of the block exactly once over its parts
    const long long n = rc::rc_emu_block_n;
    if (rc::rc_emu_block_units != n || rc::rc_emu_block_sum != n * (n - 1) / 2) ++rc::rc_emu_errors;
  }
  return rc::rc_emu_errors;
}
// The units of one block (the launch configuration's count must agree: backends/cuda._block_units).
extern "C" int rc_units() { return rc::N_UNITS; }
extern "C" long long rc_pieces() { return rc::rc_emu_pieces; }
extern "C" long long rc_run_units() { return rc::rc_emu_run_units; }  // RC_VSEL: units of all-run blocks
// Rotation unit u's (token in the block, rotated head, chunk) (the tests check the lane mapping).
extern "C" void rc_rot_unit(int u, int* out) {
  const rc::RotIdx r = rc::rot_idx(u);
  out[0] = r.tt, out[1] = r.h, out[2] = r.j;
}
extern "C" int rc_kpairs() { return rc::KPAIRS; }
// RC_TOKEN_SCALES: 1 if k rows reduce over their rotation lanes, | 2 if v rows over their V lanes.
extern "C" int rc_token_lanes() { return rc::TOKEN_LANES | (rc::V_LANES << 1); }
#endif
