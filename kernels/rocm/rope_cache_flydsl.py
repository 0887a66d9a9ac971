"""rope_and_cache as ONE FlyDSL kernel for AMD GPUs (gfx942 / gfx950), compiled without a GPU.

Static configuration: a `RocmKernelConfig` (jax_rope_cache/rocm.py builds it from an OpSpec).
Every option of the op contract is a compile-time parameter: NeoX / GPT-J pairing, partial
rotary (R < D), "half" / "full" cos/sin tables, the six cache layouts (any power-of-two X of the
x-packed ones: `pack_x`; head_major's blocks per layer `nb`, as its caches lead with KH; kv_merged's V
rows in the key cache, its value_cache operand a placeholder never touched), bf16/f16/f32 inputs, bf16/f16/f32 tables, caches of the input dtype or float8 e4m3fn / e4m3fnuz / e5m2 (every format on both
archs: the conversion is integer arithmetic, not the hardware's fp8 instructions), per-tensor
k/v scales, "fp32" and "native" precision, int32/int64 slot_mapping and positions, one cache or
stacked per-layer caches [L, NB, ...] (`layer_blocks` = NB) with the layer read on the device,
multimodal RoPE (`mrope`: positions [3, T], see below).

Kernel ABI (what kernels/ffi/gpu_launcher.cc packs): 32 kernel arguments of 8 bytes each, at
byte offsets 0, 8, ..., 248 (kernarg segment 256 bytes, no hidden arguments):
  0..13   device addresses of the operands  q, k, v, key_cache, value_cache, slot_mapping,
          positions, cos, sin, k_scale, v_scale (f32 [] or [KH]), layer (int32 scalar),
          q_norm_weight, k_norm_weight ([D], or an f32[1] placeholder when absent)
  14..17  device addresses of the results   q_out, k_out, key_cache_out, value_cache_out
  18..31  int64 dim0 of each operand (T = dim0[0], NB = dim0[3] (stacked: L; head_major: `nb`), max_pos = dim0[7]);
          T is q's dim0 (positions has dim0 3 with M-RoPE)
With per-token scales (`token_scales`) k_scale / v_scale are the scale caches and the results
k_scale_cache_out, v_scale_cache_out follow at 18, 19: 34 arguments (272 bytes), dim0s at 20..33.
The extra operands (`rope_switch`: use_rope, int32 []; `temp_floor`: temperature_factors, f32) follow
the 14 operands: the results and the dim0s move up by their count (kernel_args: 34, 36 or 38).
Grid: (ceil(T / TPB), SPLIT, 1) workgroups of NT threads (NT is the required workgroup size).

Work decomposition. A workgroup owns TPB consecutive tokens (latency regime, small T: one token,
one unit per lane, half-width rotation chunks; see make_config). Three phases run one after the other
(no shared memory, no barriers), or, split (latency regime, tokens of many lanes: `split` = the
number of phases), each in its own workgroup of the token (grid.y = phase), side by side on
different CUs instead of in turn; each maps its lanes as (token sub-slot, head slot, chunk):
  * rot  : the rotary channels of the QH + KH heads. A lane owns one chunk of W rotary pairs
           (NeoX: channels [cW, cW+W) and [R/2+cW, R/2+cW+W): two 16-byte loads; GPT-J: one
           chunk of W channels holding W/2 pairs). It loads its cos/sin chunk ONCE per token and
           reuses it for every Q and K head it visits. K heads also write the key cache.
  * pass : channels >= R of every Q and K head (copied; K also to the key cache). Only if R < D.
  * v    : V heads copied into the value cache.
All loads of a (token, phase) iteration are issued before the first store; a lane makes one access
per chunk (Q and K heads branch on the head kind, which is uniform per wave whenever QH is a
multiple of the heads one wave covers). q/k/v/q_out/k_out, slot_mapping and positions are
accessed with 32-bit-offset buffer instructions through descriptors based at the workgroup's first
token row, whose size covers only the valid rows (the hardware drops accesses past T); the tables
through one descriptor over all max_pos rows. The caches (any size) are written with 64-bit global
stores.

32-bit limits. A buffer access adds a 32-bit byte offset to its descriptor's base and checks it
against the descriptor's 32-bit num_records, so what one descriptor covers must stay below 4 GiB:
  * cos / sin: max_pos rows, addressed from the table's start: each table < 4 GiB
    (TABLE_BYTES_LIMIT; past it a row's offset would wrap onto another row);
  * the per-workgroup descriptors of q, k, v (or the fused QKV rows), q_out, k_out, slot_mapping
    and positions: TPB rows each, at most OOB_OFFSET bytes (span_problem), so that OOB_OFFSET, the
    offset a lane of a missing head uses, lies past every one of them;
  * norm weights, scales, layer: a few bytes.
Both are refused at lowering (jax_rope_cache/backends/rocm.py, refuse_buffer_limits: impl=None
falls back to the XLA path). The caches, the scale caches and every index compare are 64-bit.

Bounds: positions clamped to [0, max_pos - 1] (in 64-bit; M-RoPE: each stream on its own); a cache
row is written only when the token exists (t < T) and 0 <= slot < NB*BS (64-bit compare; stacked:
and 0 <= layer < L, the row then lands in layer `layer`). Offsets into the caches are 64-bit.
Arithmetic (bit-exact with jax_rope_cache.reference and kernels/common/rope_cache_math.h):
`arith_mode` picks "fp32", native "rounded" (tables in the input dtype) or native "fused" (any
other table dtype, or f32 inputs). fp32 and "rounded" use separate f32 multiply / add / subtract
(no contraction: no fast-math flags are set, and the compile-only test checks their ISA has no
FMA/MAD); "fused" makes its first product an llvm.intr.fma (v_fma_f32, one rounding) and an fp8
key cache then quantizes the f32 values before the final rounding. bf16 and fp8 rounding in
integer arithmetic (round to nearest even, fp8 saturates), f16 by the hardware conversion (RNE);
every NaN written is the canonical one of rope_cache_math.h (bf16/f16 0x7FFF, f32 0x7FFFFFFF,
e4m3fn 0x7F, e4m3fnuz 0x80, e5m2 0x7F). 1/scale by a correctly rounded f32 division, an overflow to +-inf
replaced by +-FLT_MAX (rc_inv_scale). Tables are never rounded. Per-head scales ([KH]): each
lane computes 1/scale[h] once per head it visits (before the token loop).

QK-RMSNorm (q_norm / k_norm: weight dtype codes; reference.rms_norm). The rotation
phase's lanes of a (token, head) hold its whole row (`norm_layout`): the rotation chunks and, when
R < D, the channels >= R as the tree's nodes spread evenly over the same lanes (the pass-through
phase then has nothing left to do). S follows the reference's halving tree exactly: each lane
reduces each of its chunks by the tree (a chunk is a node), then an xor butterfly over the head's
lanes (a power of two, one wave, aligned) adds sibling nodes: lane_xor 1/2 DPP quad_perm, 4/8 DPP
row_half_mirror/row_mirror (equal to xor 4/8 on values already equal per 4/8 lanes), 16
ds_swizzle, 32 ds_bpermute; families are combined by the tree above them (NeoX R = D: the two
halves, added last). inv = 1/sqrt(ms + eps) as llvm.sqrt (the backend's correctly rounded
expansion) and an IEEE division; S/D as a multiplication by 2^-k for D a power of two (the same
rounding). y and n rounded as the reference; the other kind's heads (one norm only) skip it in a
branch yielding the packed words, so their channels keep their bits. Where the chunks do not line up
with the tree (D = 80, R = 3D/4, ...) every lane reloads its row piece by piece (correct; more
registers). The weights load after the sum (latency regime: with the q/k chunks) and the tables
after the norm (not live across it).

Per-token fp8 scales (`token_scales`; reference.token_scale): the rotation lanes of a (token, head)
hold its whole K row as with the norm (norm_layout; no pass-through phase), the V phase's lanes its
V row. Each row's absolute maximum is an unsigned max of |x|'s bits (NaN and inf as 0), then the
norm's xor butterfly with that max (token_scale_row); scale and 1/scale by correctly rounded
divisions; the row's first lane writes the scale. Rows that are no power-of-two lane group of one
wave are refused (token_scales_problem).

Model families (docs/rocm.md#model-family-options): R = 0 (no rotation phase: the pass-through phase
holds whole rows, its lanes' xor butterfly sums a row for the norm and scales it), `tail` (rotary
channels [D - R, D)), `rope_switch` (the rotation lanes select the unrotated bits on a call that does
not rotate), `norm_type` GEMMA / WEIGHTLESS, `norm_after` (the rotated row normalised by the rotation
lanes: family_problem), `temp_floor` (q * factor on calls that do not rotate), `q_gate` (q head h at
row 2h of the fused rows). int8 caches (`INT8`): per-token scales with 127, quantized on the bits
(f32_to_int_bits). NVFP4 / MXFP4 (`block_fmt`): the INT4 bytes hold E2M1 codes (e2m1_code) with one
scale per block of 16 / 32 channels of a row, its amax by the xor butterfly over the block's lanes
(block_plan; block_problem refuses the rest), the scale byte by block_scale.

Multimodal RoPE (`mrope` 1: sections, 2: interleaved; `mrope_t/h/w` the frequency counts; 0: off,
positions [T], and the code is that of a kernel without the option). positions is [3, T]: stream s
of token t at element s*T + t, read through one descriptor per stream (based at the workgroup's
first token of that stream, sized to its valid rows, as the one-stream descriptor). A lane's pairs
are rotary frequencies i = c*npairs + k (chunk c, pair k < npairs) in every style and table kind
(NeoX: column i, and R/2 + i of a "full" table; GPT-J "full": columns 2i, 2i + 1), so the lane loads
its chunk of the cos/sin row of every stream the sections use (each clamped on its own) and picks
pair k's values by integer compares on i (mrope_selector: sections i < t, i < t + h; interleaved
i mod 3 from one remainder per lane, and i < 3h / i < 3w). Only the rows change: the rotation,
norm and stores are those of the one-stream kernel.
"""

import dataclasses
import struct

KERNEL_BASENAME = "jrc_rope_cache"
NUM_OPERANDS = 14  # the custom call's operands
NUM_ADDRS = NUM_OPERANDS + 4  # then its 4 results (6 with per-token scales: num_results)
NUM_ARGS = NUM_OPERANDS + 6 + NUM_OPERANDS  # what the launch function takes (the kernel: kernel_args)
ARG_BYTES = 8

# dtype codes: jax_rope_cache/_spec.py DTYPE_CODES
F32, BF16, F16, FP8_FN, FP8_FNUZ, FP8_E5M2 = 0, 1, 2, 3, 4, 5
INT8 = 6  # an int8 cache (per-token scales only; backends/rocm.py maps np.int8 to it)
INT4 = 7  # an int4 cache: uint8 bytes, channel 2j in the low nibble (per-token scales only)
ITEMSIZE = {F32: 4, BF16: 2, F16: 2, FP8_FN: 1, FP8_FNUZ: 1, FP8_E5M2: 1, INT8: 1, INT4: 1}  # INT4: a byte (2 values)
FP8_CODES = (FP8_FN, FP8_FNUZ, FP8_E5M2)
FP8_MAX = {FP8_FN: 448.0, FP8_FNUZ: 240.0, FP8_E5M2: 57344.0}  # contract.FP8_MAX
QUANT_MAX = {**FP8_MAX, INT8: 127.0, INT4: 7.0}
LOW_BIT = (INT8, INT4)  # contract.QUANT_MAX: a per-token scale is amax / this
TOKEN_AMAX_FLOOR_BITS = struct.unpack("<I", struct.pack("<f", 1e-8))[0]  # contract.TOKEN_AMAX_FLOOR (f32)
FLASH, XPACKED, XPACKED_SHUFFLED, HND, HEAD_MAJOR, KV_MERGED = 0, 1, 2, 3, 4, 5  # contract.LAYOUT_TABLE codes
RMS, GEMMA, WEIGHTLESS = 0, 1, 2  # norm_type codes (contract.NORM_TYPES)
# block_fmt codes: an INT4-coded cache of E2M1 values with one scale per block of channels
NVFP4, MXFP4 = 1, 2
BLOCK_GROUP = {NVFP4: 16, MXFP4: 32}  # contract.BLOCK_GROUP
TABLE_BYTES_LIMIT = 1 << 32  # a cos/sin table must be smaller (32-bit buffer offsets; module docstring)
OOB_OFFSET = 0x7FFFFFF0  # past every per-workgroup descriptor (span_problem): loads 0, stores dropped


@dataclasses.dataclass(frozen=True)
class RocmKernelConfig:
    qh: int
    kh: int
    d: int
    r: int
    bs: int
    layout: int        # 0 flash, 1 xpacked, 2 xpacked_shuffled, 3 hnd, 4 head_major, 5 kv_merged
    neox: bool
    full_table: bool
    native: bool       # "native" precision (arith_mode: "rounded" or "fused")
    dt: int            # q/k/v dtype code
    tab_dt: int        # cos/sin dtype code
    cache_dt: int      # cache dtype code
    slot64: bool
    pos64: bool
    w_rot: int         # elements per rotation chunk (pairs per lane for NeoX, channels for GPT-J)
    w_pass: int        # elements per pass-through chunk
    w_v: int           # elements per V chunk
    tpb: int           # tokens per workgroup
    nt: int            # threads per workgroup
    layer_blocks: int = 0  # 0: one cache [NB, ...]; NB: stacked caches [L, NB, ...]
    q_norm: int = -1       # -1: no q RMSNorm, else the dtype code of q_norm_weight
    k_norm: int = -1       # same for k_norm_weight
    norm_eps: float = 0.0  # float32 eps (exact in f32); 0.0 without a norm
    k_scale_heads: bool = False  # k_scale is [KH] (else one scale)
    v_scale_heads: bool = False
    latency: bool = False  # the latency regime (make_config): one token per workgroup, norm weights early
    split: int = 1  # workgroups per token block (grid.y): part y runs phase y (phases(): rot, [pass], v)
    mrope: int = 0     # 0: positions [T]; 1: M-RoPE sections; 2: M-RoPE interleaved (positions [3, T])
    mrope_t: int = 0   # the sections (temporal, height, width frequency counts; 0 without M-RoPE)
    mrope_h: int = 0
    mrope_w: int = 0
    # X of the x-packed layouts when not 16 bytes of cache elements (the key cache's last dim); 0: the
    # default. A key-cache store of a chunk wider than X is one store per X group.
    pack_x: int = 0
    # the q, k and v operands are each the fused QKV tensor [T, QH + 2 KH, D] (q heads, then k heads,
    # then v heads of a token): inputs read at those head offsets with that row stride
    qkv: bool = False
    # per-token fp8 scales: k_scale / v_scale are the scale caches [NB, KH, BS] (head_major [KH, NB, BS];
    # stacked [L, ...], f32), results 4 and 5; each (token, kv head) row is quantized with its own scale
    # (token_scale_row)
    token_scales: bool = False
    # head_major: the blocks per layer (its caches [.., KH, NB, BS, D] do not lead with NB); 0 otherwise
    nb: int = 0
    # ---- model families (each off by default: the code of a configuration without them is unchanged)
    tail: bool = False        # rotary channels [D - R, D), pass-through [0, D - R) (rotary_position="tail")
    rope_switch: bool = False  # the int32 [] use_rope operand (after the 14) switches the rotation per call
    norm_type: int = RMS      # RMS w * r(x * inv); GEMMA r((x * inv) * (1 + w)); WEIGHTLESS r(x * inv), q and k
    norm_after: bool = False  # the norm runs on the rotated row (calls that rotate only)
    temp_floor: int = 0       # attention temperature's floor_scale (0: off): q * factor on calls that do not rotate
    q_gate: bool = False      # fused QKV rows [T, 2 QH + 2 KH, D]: q head h at row 2h (its gate at 2h + 1)
    # NVFP4 / MXFP4 (block_problem): the INT4 cache holds E2M1 codes, the scale caches block scales
    # [.., D / BLOCK_GROUP] bytes next to each cache row (E4M3; E8M0); NVFP4's global scales are the last operands
    block_fmt: int = 0

    @property
    def x(self) -> int:
        return self.pack_x or 16 // ITEMSIZE[self.cache_dt]

    @property
    def packed(self) -> bool:
        return self.layout in (XPACKED, XPACKED_SHUFFLED)

    @property
    def norm(self) -> bool:
        return self.q_norm >= 0 or self.k_norm >= 0 or self.norm_type == WEIGHTLESS

    @property
    def rot_lo(self) -> int:
        """The first rotary channel."""
        return self.d - self.r if self.tail else 0

    @property
    def pass_lo(self) -> int:
        """The first pass-through channel (they are [pass_lo, pass_lo + D - R))."""
        return 0 if self.tail else self.r

    def key(self) -> str:
        out = []
        for f in dataclasses.fields(self):
            if f.name in _FAMILY_DEFAULTS and getattr(self, f.name) == _FAMILY_DEFAULTS[f.name]:
                continue  # an option off: the key of a configuration without the field
            if f.name.startswith("mrope") and not self.mrope:
                continue  # M-RoPE off: the key of a configuration without the option
            if f.name == "pack_x" and not self.pack_x:
                continue  # the default X: the key of a configuration without the option
            if f.name == "qkv" and not self.qkv:
                continue  # separate q, k, v: the key of a configuration without the option
            if f.name == "token_scales" and not self.token_scales:
                continue  # static scales: the key of a configuration without the option
            if f.name == "nb" and not self.nb:
                continue  # NB at run time: the key of a configuration without the field
            v = getattr(self, f.name)  # floats by their f32 bits: eps values must not collide
            out.append(struct.pack("<f", v).hex() if isinstance(v, float) else str(int(v)))
        return "_".join(out)


_FAMILY_DEFAULTS = dict(tail=False, rope_switch=False, norm_type=RMS, norm_after=False, temp_floor=0, q_gate=False,
                        block_fmt=0)


def num_operands(cfg: RocmKernelConfig) -> int:
    """The custom call's operands: the 14, then use_rope (rope_switch), then temperature_factors
    (temp_floor), then NVFP4's k / v global scales, as contract.extra_operands."""
    return NUM_OPERANDS + int(cfg.rope_switch) + int(cfg.temp_floor > 0) + 2 * int(cfg.block_fmt == NVFP4)


def num_results(cfg: RocmKernelConfig) -> int:
    """The custom call's results: q_out, k_out, the caches, and with per-token scales the scale caches."""
    return 6 if cfg.token_scales else 4


def kernel_args(cfg: RocmKernelConfig) -> int:
    """The kernel's 8-byte arguments: operand addresses, result addresses, operand dim0s (32, or 34
    with per-token scales; 2 more per extra operand)."""
    return num_operands(cfg) + num_results(cfg) + num_operands(cfg)


MAX_LAUNCH_ARGS = NUM_OPERANDS + 2 + 6 + NUM_OPERANDS + 2  # both extra operands, per-token scales


def launch_args(cfg: RocmKernelConfig) -> int:
    """The arguments build_launcher's launch function takes (what the compile worker passes): NUM_ARGS,
    or MAX_LAUNCH_ARGS where the kernel takes more."""
    return NUM_ARGS if kernel_args(cfg) <= NUM_ARGS else MAX_LAUNCH_ARGS


def mrope_streams(cfg: RocmKernelConfig) -> list[int]:
    """The stream (0 temporal, 1 height, 2 width) of each rotary frequency i < R/2 of an M-RoPE
    configuration (contract.mrope_stream): sections i < t temporal, i < t + h height, else width;
    interleaved i % 3 == 1 and i < 3h height, i % 3 == 2 and i < 3w width, else temporal."""
    t, h, w = cfg.mrope_t, cfg.mrope_h, cfg.mrope_w
    if cfg.mrope == 2:
        return [1 if i % 3 == 1 and i < 3 * h else (2 if i % 3 == 2 and i < 3 * w else 0) for i in range(cfg.r // 2)]
    return [0 if i < t else (1 if i < t + h else 2) for i in range(cfg.r // 2)]


def arith_mode(cfg: RocmKernelConfig) -> str:
    """"fp32", or native "rounded" (tables in the 16-bit input dtype) / "fused" (anything else):
    rc_arith of rope_cache_math.h, reference.arithmetic."""
    if not cfg.native:
        return "fp32"
    return "rounded" if cfg.dt == cfg.tab_dt and cfg.dt in (BF16, F16) else "fused"


def _pow2_width(max_elems: int, *divides: int) -> int:
    w = max_elems
    while w > 1 and any(n % w for n in divides):
        w //= 2
    return max(1, w)


def phase_geometry(cpx: int, nh: int, nt: int) -> tuple[int, int]:
    """(heads in parallel, tokens in parallel) for a phase of `cpx` chunks per head."""
    hp = max(1, min(nh, nt // cpx))
    ts = max(1, nt // (cpx * hp))
    return hp, ts


LATENCY_TOKENS = 256  # calls of at most this many tokens: the latency regime (MI355X has 256 CUs, MI300X 304)
MAX_NT = 1024  # threads per workgroup (the hardware's limit)


# Latency configurations whose phases hold more than this many lanes in all run each phase in its own
# workgroup (RocmKernelConfig.split). The CUDA kernel's split of a decode token over blocks (H200:
# tokens of > 320 units, e.g. x-packed Llama-8B 2.54 -> 1.53 us at T = 1; one-KV-head shapes not)
# by the same rule; not timed on AMD hardware.
SPLIT_MIN_LANES = 320


def phases(cfg: "RocmKernelConfig") -> list[str]:
    """The kernel's phases in order (part y of a split configuration runs phases(cfg)[y])."""
    merged = whole_rows(cfg) and norm_layout(cfg).merged
    return (["rot"] if cfg.r else []) + (["pass"] if cfg.r < cfg.d and not merged else []) + ["v"]


def span_problem(cfg: "RocmKernelConfig") -> str | None:
    """Why one workgroup's per-token descriptors of `cfg` would span more than OOB_OFFSET bytes (None:
    they do not). Offsets into them are 32-bit and a missing head's lanes use OOB_OFFSET, which must
    lie past each of them."""
    s = ITEMSIZE[cfg.dt]
    idx = 8 if cfg.slot64 or cfg.pos64 else 4
    rows = {"q_out": cfg.qh * cfg.d * s, "k_out": cfg.kh * cfg.d * s, "slot_mapping / positions": idx}
    if cfg.qkv:
        rows["q / k / v (fused QKV)"] = (cfg.qh * (2 if cfg.q_gate else 1) + 2 * cfg.kh) * cfg.d * s
    else:
        rows["q"], rows["k / v"] = cfg.qh * cfg.d * s, cfg.kh * cfg.d * s
    name, row = max(rows.items(), key=lambda kv: kv[1])
    if cfg.tpb * row <= OOB_OFFSET:
        return None
    return (f"{name}: {cfg.tpb} token row(s) of {row} bytes per workgroup ({cfg.tpb * row} bytes), more than the "
            f"{OOB_OFFSET} bytes one 32-bit buffer descriptor addresses")


def whole_rows(cfg: "RocmKernelConfig") -> bool:
    """Whether the rotation phase's lanes of a (token, head) hold its whole row (norm_layout): the
    QK-norm's sum of squares and the per-token scale's absolute maximum are reduced over them. Without
    rotary channels (R = 0) there is no rotation phase: the pass-through phase holds the rows."""
    return cfg.r > 0 and (cfg.norm or cfg.token_scales)


def token_scales_problem(cfg: "RocmKernelConfig") -> str | None:
    """Why per-token scales do not fit `cfg` (None: they do). A row's absolute maximum is an xor
    butterfly over the lanes holding the row, so a K row (rotation phase, pass-through channels
    merged in) and a V row (V phase) must each be a power-of-two group of at most 64 lanes holding
    every channel."""
    if not cfg.token_scales:
        return None
    if cfg.cache_dt == INT4:  # a lane stores whole bytes: every chunk holds channel pairs (2j, 2j + 1)
        chunks = [(0, cfg.w_v)] + ([(cfg.pass_lo, cfg.w_pass)] if cfg.r < cfg.d else [])
        if cfg.r:
            nl = norm_layout(cfg)
            chunks += [(off, w) for off, w in nl.families] + [(off, nl.w_psub) for off, _ in nl.families[nl.n_rot:]]
        odd = [(off, w) for off, w in chunks if off % 2 or w % 2]
        if odd:
            return (f"int4 packs channel pairs into bytes, but a lane's chunk of {odd[0][1]} channel(s) at {odd[0][0]} "
                    f"(D={cfg.d}, R={cfg.r}) splits a pair")
    if not cfg.r:  # R = 0: the pass-through phase's lanes of a head hold its K row
        for what, n in (("a K row", cfg.d // cfg.w_pass), ("a V row", cfg.d // cfg.w_v)):
            if n & (n - 1) or n > 64:
                return f"{what} spans {n} lanes (D={cfg.d}, R=0): not a power of two of at most 64"
        return None
    nl = norm_layout(cfg)
    covered = sorted(ch for off, w in nl.families for ch in range(off, off + w * nl.lanes))
    cpx_v = cfg.d // cfg.w_v
    for what, n in (("a K row", nl.lanes), ("a V row", cpx_v)):
        if n & (n - 1) or n > 64:
            return f"{what} spans {n} lanes (D={cfg.d}, R={cfg.r}): not a power of two of at most 64"
    if covered != list(range(cfg.d)):
        return (f"the rotation lanes of a K row ({nl.lanes} lanes, R={cfg.r}) cannot hold its {cfg.d - cfg.r} "
                f"pass-through channels evenly")
    return None


def block_plan(off: int, w: int, lanes: int, group: int) -> int | None:
    """The lanes n over which a block of `group` channels spreads in a family of chunks (lane c holds
    [off + c*w, off + (c+1)*w) of a row over `lanes` lanes): an aligned group of n = group / w lanes
    (its amax by the xor butterfly), or None. A chunk is at most 16 bytes of input (8 channels), so a
    block of 16 or 32 never sits within one lane."""
    if off % group or group % w or (w * lanes) % group:
        return None
    return group // w


def block_rows(cfg: "RocmKernelConfig") -> list:
    """[(what, families, lanes)] of the rows a NVFP4 / MXFP4 cache quantizes: the K row (rotation lanes
    with the pass-through channels merged in, or the pass-through phase's lanes for R = 0), the V row."""
    k = (("a K row", norm_layout(cfg).families, norm_layout(cfg).lanes) if cfg.r else
         ("a K row", ((cfg.pass_lo, cfg.w_pass),), cfg.d // cfg.w_pass))
    return [k, ("a V row", ((0, cfg.w_v),), cfg.d // cfg.w_v)]


def block_problem(cfg: "RocmKernelConfig") -> str | None:
    """Why a NVFP4 / MXFP4 cache does not fit `cfg` (None: it does): every lane chunk of a row must be
    an even share of one block spread over an aligned lane group (block_plan); NVFP4's global
    scales plus use_rope / temperature_factors exceed the launcher's arguments."""
    if not cfg.block_fmt:
        return None
    name, g = ("NVFP4" if cfg.block_fmt == NVFP4 else "MXFP4"), BLOCK_GROUP[cfg.block_fmt]
    if kernel_args(cfg) > MAX_LAUNCH_ARGS:
        return (f"{name} with the use_rope switch or the attention temperature (the global scales and those "
                f"operands make {kernel_args(cfg)} kernel arguments, the launcher takes {MAX_LAUNCH_ARGS})")
    problem = token_scales_problem(cfg)
    if problem is not None:
        return problem
    for what, fams, lanes in block_rows(cfg):
        for off, w in fams:
            if block_plan(off, w, lanes, g) is None:
                return (f"{name} blocks of {g} channels: {what}'s lane chunks of {w} channel(s) from channel {off} "
                        f"({lanes} lanes; D={cfg.d}, R={cfg.r}) do not split each block over an aligned lane group")
    return None


def family_problem(cfg: "RocmKernelConfig") -> str | None:
    """Why the kernel does not implement the model-family options of `cfg` for its shape (None: it
    does). The norm after the rotation sums the rotated row: the rotation lanes must hold the whole
    row and reduce it by the xor butterfly (norm_layout's plan), with no pass-through phase of its own."""
    if not cfg.norm_after:
        return None
    nl = norm_layout(cfg) if whole_rows(cfg) else None
    if nl is None or nl.plan is None or (cfg.r < cfg.d and not nl.merged):
        return (f"norm_position='after' for this shape (the norm of the rotated row needs the row held by one "
                f"power-of-two group of rotation lanes that the reduction tree fits; D={cfg.d}, R={cfg.r})")
    return None


def phase_lanes(cfg: "RocmKernelConfig") -> dict[str, int]:
    """Lanes each phase of one token maps (rotation chunks, pass-through chunks, V chunks, all heads)."""
    rh = cfg.qh + cfg.kh
    cpx = (cfg.r // 2) // cfg.w_rot if cfg.neox else cfg.r // cfg.w_rot
    lanes = {"rot": cpx * rh, "pass": (cfg.d - cfg.r) // cfg.w_pass * rh, "v": cfg.d // cfg.w_v * cfg.kh}
    return {p: lanes[p] for p in phases(cfg)}


def latency_regime(num_tokens: int | None) -> bool:
    """Whether a call of `num_tokens` tokens (static per call site; None: unknown) gets the latency
    configuration: one token per workgroup, so the grid of T workgroups still fits the CUs once."""
    return num_tokens is not None and 0 < num_tokens <= LATENCY_TOKENS


def make_config(*, qh, kh, d, r, bs, layout, neox, full_table, native, dt, tab_dt, cache_dt, slot64,
                pos64, layer_blocks: int = 0, q_norm: int = -1, k_norm: int = -1, norm_eps: float = 0.0,
                k_scale_heads: bool = False, v_scale_heads: bool = False, mrope: int = 0, mrope_t: int = 0,
                mrope_h: int = 0, mrope_w: int = 0, x: int = 0, qkv: bool = False, token_scales: bool = False,
                nb: int = 0, tail: bool = False, rope_switch: bool = False, norm_type: int = RMS,
                norm_after: bool = False, temp_floor: int = 0, q_gate: bool = False, block_fmt: int = 0, nt: int = 256,
                rot_cap: int | None = None, width_cap: int | None = None, latency: bool = False) -> RocmKernelConfig:
    """`rot_cap` / `width_cap`: at most that many elements per rotation chunk / per pass-through and
    V chunk (narrower accesses, fewer values in flight per lane: the occupancy candidates of
    jax_rope_cache/backends/rocm.py; None = as wide as 16 bytes and the shape allow).
    `mrope` (1 sections, 2 interleaved) with `mrope_t/h/w` summing to R/2: multimodal RoPE; the
    geometry is that of the same shape without it (only the table rows differ).
    `x`: X of the x-packed layouts (a power of two dividing D, and BS for xpacked_shuffled); 0 or
    16 // cache itemsize: the default.
    `qkv`: q, k and v are each the fused [T, QH + 2 KH, D] tensor (the geometry is unchanged; only the
    input rows' stride and head offsets differ).
    `token_scales`: per-token fp8 scales (an fp8 cache, no static per-head scales); the rotation
    lanes hold whole K rows as with the norm (token_scales_problem says where that cannot be).
    `nb`: head_major's blocks per layer (required there, 0 for every other layout).
    Model families: `r` 0 (no rotary channels: the pass-through phase copies, normalises and scales
    whole rows), `tail`, `rope_switch`, `norm_type`, `norm_after`, `temp_floor`, `q_gate` (the
    RocmKernelConfig fields; family_problem says which shapes they cannot take).

    Two regimes (`latency`, from latency_regime(T)):
      * bandwidth (large or unknown T): `nt` threads, as many tokens per workgroup as its lanes hold;
      * latency (small T): one token per workgroup, one unit per lane (nt = the largest phase's
        lanes, up to MAX_NT) and, as made (rot_cap None), rotation chunks of half the width: twice
        the lanes, half the serial work per lane (loads, the norm's sum, normalise, rotation). Only
        where one token's rotation units still fit a workgroup and, with the norm, its butterfly
        stays within 32 lanes (DPP and ds_swizzle; not ds_bpermute nor the row reload)."""
    s = ITEMSIZE[dt]
    vmax = 16 // s
    if norm_type not in (RMS, GEMMA, WEIGHTLESS):
        raise ValueError(f"norm_type: expected {RMS} (rms), {GEMMA} (gemma) or {WEIGHTLESS} (weightless), "
                         f"got {norm_type}")
    weights = q_norm >= 0 or k_norm >= 0
    if (norm_type == GEMMA and not weights) or (norm_type == WEIGHTLESS and weights):
        raise ValueError(f"norm_type: {norm_type} with q_norm={q_norm}, k_norm={k_norm}: gemma needs a weight, "
                         "weightless takes none")
    norm = weights or norm_type == WEIGHTLESS
    if (tail or rope_switch or norm_after) and not r:
        raise ValueError(f"tail / rope_switch / norm_after: expected rotary channels (R > 0), got R={r}")
    if norm_after and not norm:
        raise ValueError("norm_after: expected a norm (q_norm / k_norm or the weightless norm_type)")
    if q_gate and not qkv:
        raise ValueError("q_gate: expected the fused QKV input (qkv=True)")
    if temp_floor < 0 or (temp_floor and r and not rope_switch):
        raise ValueError(f"temp_floor: expected >= 0, and with R > 0 a rope_switch, got {temp_floor} (R={r})")
    whole = r > 0 and (norm or token_scales)  # the rotation lanes hold whole rows (norm_layout)
    if (token_scales and (cache_dt not in FP8_CODES + LOW_BIT or k_scale_heads or v_scale_heads)) or (
            cache_dt in LOW_BIT and not token_scales):
        raise ValueError(f"token_scales: expected an fp8 cache ({FP8_CODES}) or an int8 / int4 one ({LOW_BIT}, always "
                         f"per-token) without per-head static scales, got token_scales={token_scales}, "
                         f"cache_dt={cache_dt}, k_scale_heads={k_scale_heads}, v_scale_heads={v_scale_heads}")
    if block_fmt and (block_fmt not in BLOCK_GROUP or cache_dt != INT4 or not token_scales
                      or layout not in (FLASH, HND, HEAD_MAJOR) or d % BLOCK_GROUP[block_fmt]):
        raise ValueError(f"block_fmt: expected {NVFP4} (NVFP4) or {MXFP4} (MXFP4) with an INT4-coded cache, "
                         f"token_scales, a flash / hnd / head_major layout and D a multiple of the block, got "
                         f"block_fmt={block_fmt}, cache_dt={cache_dt}, token_scales={token_scales}, layout={layout}, "
                         f"D={d}")
    x = int(x)
    if x and layout in (XPACKED, XPACKED_SHUFFLED):
        if x & (x - 1) or (d // 2 if cache_dt == INT4 else d) % x or (layout == XPACKED_SHUFFLED and bs % x):
            raise ValueError(f"x: expected a power of two dividing D={d}" + (f" and BS={bs}" if layout ==
                             XPACKED_SHUFFLED else "") + f", got {x}")
    pack_x = x if x and layout in (XPACKED, XPACKED_SHUFFLED) and x != 16 // ITEMSIZE[cache_dt] else 0
    if (layout == HEAD_MAJOR) != (int(nb) > 0) or (layer_blocks and nb and layer_blocks != nb):
        raise ValueError(f"nb: expected head_major's blocks per layer (> 0) for layout 4 and 0 otherwise, got "
                         f"nb={nb} for layout {layout}")
    if mrope not in (0, 1, 2):
        raise ValueError(f"mrope: expected 0 (off), 1 (sections) or 2 (interleaved), got {mrope}")
    section = (int(mrope_t), int(mrope_h), int(mrope_w)) if mrope else (0, 0, 0)
    if mrope and (min(section) < 0 or sum(section) != r // 2):
        raise ValueError(f"mrope_t/h/w: expected counts >= 0 summing to R/2 = {r // 2}, got {list(section)}")
    if mrope == 2:
        h_, w_ = section[1], section[2]
        got = [sum(1 for i in range(r // 2) if i % 3 == 1 and i < 3 * h_),
               sum(1 for i in range(r // 2) if i % 3 == 2 and i < 3 * w_)]
        if got != [h_, w_]:
            raise ValueError(f"mrope_t/h/w: interleaved sections {list(section)} do not fit R/2 = {r // 2}")

    def rot_width(cap):
        cap = min(vmax, cap)
        if cache_dt == INT4:
            cap = max(cap, 2)  # int4: whole channel pairs per lane (token_scales_problem)
        if whole and r < d:
            # the norm's (or the row scale's) lanes also hold the channels >= R: narrower rotation chunks keep a lane's
            # share of the row at 2 x 16 bytes (more lanes per head, one butterfly step more)
            share = max(1, (vmax * r // d) * (1 if neox else 2))
            cap = min(cap, max(1 if neox else 2, 1 << (share.bit_length() - 1)))  # a power of two
        if not r:
            return 1  # no rotation phase
        # tail: chunks start at D - R + c*W, so W divides D - R too (aligned accesses, whole X groups)
        also = (d - r,) if tail else ()
        w = _pow2_width(cap, r // 2, *also) if neox else _pow2_width(cap, r, *also)
        return max(w, 1 if neox else 2)

    wmax = min(vmax, width_cap or vmax)
    if cache_dt == INT4:
        wmax = max(wmax, 2)
    w_pass = _pow2_width(wmax, r, d) if r < d else 1
    w_v = _pow2_width(wmax, d)
    rh = qh + kh

    def build(w_rot, nt, tpb):
        return RocmKernelConfig(qh=qh, kh=kh, d=d, r=r, bs=bs, layout=layout, neox=bool(neox),
                                full_table=bool(full_table), native=bool(native), dt=dt, tab_dt=tab_dt,
                                cache_dt=cache_dt, slot64=bool(slot64), pos64=bool(pos64), w_rot=w_rot,
                                w_pass=w_pass, w_v=w_v, tpb=tpb, nt=nt, layer_blocks=int(layer_blocks),
                                q_norm=int(q_norm), k_norm=int(k_norm),
                                norm_eps=float(norm_eps) if norm else 0.0, k_scale_heads=bool(k_scale_heads),
                                v_scale_heads=bool(v_scale_heads), latency=bool(latency), mrope=int(mrope),
                                mrope_t=section[0], mrope_h=section[1], mrope_w=section[2], pack_x=pack_x,
                                qkv=bool(qkv), token_scales=bool(token_scales), nb=int(nb), tail=bool(tail),
                                rope_switch=bool(rope_switch), norm_type=int(norm_type), norm_after=bool(norm_after),
                                temp_floor=int(temp_floor), q_gate=bool(q_gate), block_fmt=int(block_fmt))

    def cpx(w):
        if not r:  # no rotation phase: the pass-through phase's geometry leads
            return d // w_pass
        return (r // 2) // w if neox else r // w

    w_rot = rot_width(rot_cap or vmax)
    if not latency:
        nt = max(64, min(nt, MAX_NT))
        while nt > 64 and cpx(w_rot) * rh <= nt // 2 and cpx(w_rot) * rh * 4 < 64:
            nt //= 2  # tiny heads: keep the workgroup small rather than idle
        return build(w_rot, nt, phase_geometry(cpx(w_rot), rh, nt)[1])

    def one_token(w):
        """The latency configuration with rotation chunks of w elements: nt = the lanes of the
        largest phase of one token (rotation, pass-through unless merged, V), in whole waves."""
        c = build(w, 64, 1)
        return dataclasses.replace(c, nt=min(MAX_NT, max(64, -(-max(phase_lanes(c).values()) // 64) * 64)))

    cfg = one_token(w_rot)
    half = rot_width(w_rot // 2) if rot_cap is None else w_rot
    if r and half < w_rot and cpx(half) * rh <= MAX_NT:
        narrow = one_token(half)
        nl = norm_layout(narrow) if whole_rows(narrow) else None
        ok = nl is None or nl.lanes <= 32  # a row's butterfly within 32 lanes (DPP and ds_swizzle)
        if narrow.norm:
            ok = ok and nl.plan is not None and norm_layout(cfg).plan is not None
        if narrow.token_scales:
            ok = ok and token_scales_problem(narrow) is None
        if narrow.block_fmt:
            ok = ok and block_problem(narrow) is None
        if ok:
            cfg = narrow
    if sum(phase_lanes(cfg).values()) > SPLIT_MIN_LANES:
        cfg = dataclasses.replace(cfg, split=len(phases(cfg)))
    return cfg


# ------------------------------------------------------------------------------------------------
# QK-RMSNorm: the sum of squares of a (token, head) row in the reference's halving tree
# ------------------------------------------------------------------------------------------------
def tree_sum(vals: list, add):
    """The reference's pairwise halving tree (reference.tree_sum) over vals in channel order."""
    n = len(vals)
    if n == 1:
        return vals[0]
    if n % 2 == 0:
        return add(tree_sum(vals[: n // 2], add), tree_sum(vals[n // 2:], add))
    return add(tree_sum(vals[:-1], add), vals[-1])


@dataclasses.dataclass(frozen=True)
class NormLayout:
    """How the rotation phase's lanes hold a head row when a norm is on.

    lanes: lanes per (token, head) (the rotation phase's chunks per head). Lane c holds, for each
    family (first channel, width), channels [first + c*width, first + (c+1)*width): the rotation
    chunks (n_rot families), then, when `merged`, the channels >= R (else a separate pass-through
    phase copies them), in sub-chunks of w_psub channels. plan: how S is formed from the families:
    ("local",) one lane holds the row; ("fam", j) family j reduced by the tree in each lane, then an
    xor butterfly over the lanes (their chunks are that node's descendants, so this IS the tree);
    ("add", a, b) the node's two halves. None: the families do not line up with the tree; every
    lane then reloads its whole row."""
    lanes: int
    families: tuple
    n_rot: int
    merged: bool
    w_psub: int
    plan: tuple | None

    @property
    def groups(self) -> list:
        """Chunks per family, in chunk order."""
        return [1] * self.n_rot + [w // self.w_psub for _, w in self.families[self.n_rot:]]


def _butterfly_plan(d: int, families, lanes: int):
    if lanes & (lanes - 1) or lanes > 64:  # the xor butterfly needs a power-of-two group in one wave
        return None

    def node(lo, n):
        for j, (off, w) in enumerate(families):
            if off == lo and w * lanes == n:
                return ("fam", j)
        if n >= 2 and n % 2 == 0:
            a, b = node(lo, n // 2), node(lo + n // 2, n // 2)
            if a is not None and b is not None:
                return ("add", a, b)
        return None

    return node(0, d)


def _pass_families(d: int, r: int, lanes: int, tail: bool = False):
    """The pass-through channels ([r, d), or [0, d - r) with the rotary channels at the tail) as the
    tree's nodes, each spread evenly over the lanes (so the butterfly reduces it), or None."""
    out = []
    plo, phi = (0, d - r) if tail else (r, d)

    def node(lo, n):
        if lo >= phi or lo + n <= plo:  # wholly rotary channels
            return True
        if lo >= plo and lo + n <= phi and n % lanes == 0:
            out.append((lo, n // lanes))
            return True
        if n % 2 or (lo >= plo and lo + n <= phi):
            return False
        return node(lo, n // 2) and node(lo + n // 2, n // 2)

    return out if node(0, d) else None


def norm_layout(cfg: RocmKernelConfig) -> NormLayout:
    D, R, W = cfg.d, cfg.r, cfg.w_rot
    lanes = (R // 2) // W if cfg.neox else R // W
    o, p0 = cfg.rot_lo, cfg.pass_lo
    fams = [(o, W), (o + R // 2, W)] if cfg.neox else [(o, W)]
    n_rot = len(fams)
    pfams = []
    if whole_rows(cfg) and R < D:
        if lanes == 1:  # the lane holds the row: one segment
            pfams = [(p0, D - R)]
        else:
            pfams = (_pass_families(D, R, lanes, cfg.tail)
                     or ([(p0, (D - R) // lanes)] if (D - R) % lanes == 0 else []))
    w_psub = _pow2_width(cfg.w_pass, *[v for f in pfams for v in f]) if pfams else 0  # aligned, one X-group
    fams += pfams
    covered = sorted(ch for off, w in fams for ch in range(off, off + w * lanes))
    if covered != list(range(D)):
        plan = None
    elif lanes == 1:
        plan = ("local",)
    else:
        plan = _butterfly_plan(D, fams, lanes)
    return NormLayout(lanes=lanes, families=tuple(fams), n_rot=n_rot, merged=bool(pfams), w_psub=w_psub, plan=plan)


# ------------------------------------------------------------------------------------------------
# M-RoPE: which stream's table values a pair takes
# ------------------------------------------------------------------------------------------------
def mrope_selector(E, cfg: RocmKernelConfig, i0):
    """(order, take) for folding the used streams' table values into one value per pair: the lane
    starts from stream order[0]'s values and, for each later stream st of `order`, pair k takes
    st's value where take(k, st) (an i1) holds. i0: the lane's first rotary frequency (i32); pair
    k is frequency i = i0 + k (k static). Sections (monotone, folded width, height, temporal):
    height where i < t + h, temporal where i < t. Interleaved (from temporal): height where
    i mod 3 == 1 and i < 3h, width where i mod 3 == 2 and i < 3w (i mod 3 from one remainder per
    lane, then static steps)."""
    t, h, w = cfg.mrope_t, cfg.mrope_h, cfg.mrope_w
    c32 = E.i32c
    used = sorted(set(mrope_streams(cfg)))
    if cfg.mrope == 1:
        order = used[::-1]
    else:
        order = ([0] if 0 in used else []) + [st for st in used if st != 0]
    conds, rems = {}, {}
    m = E.arith.remui(i0, c32(3)) if cfg.mrope == 2 and len(used) > 1 else None

    def rem(k):  # (i0 + k) mod 3, from m = i0 mod 3
        if k % 3 not in rems:
            v = E.add(m, c32(k % 3)) if k % 3 else m
            rems[k % 3] = E.sel(E.cmp("uge", v, c32(3)), E.sub(v, c32(3)), v) if k % 3 else v
        return rems[k % 3]

    def take(k, st):
        if (k, st) not in conds:
            i = E.add(i0, c32(k)) if k else i0
            if cfg.mrope == 1:
                conds[k, st] = E.cmp("slt", i, c32(t if st == 0 else t + h))
            else:
                n = h if st == 1 else w
                conds[k, st] = E.and1(E.cmp("eq", rem(k), c32(st)), E.cmp("slt", i, c32(3 * n)))
        return conds[k, st]

    return order, take


# ------------------------------------------------------------------------------------------------
# IR emission (runs inside a FlyDSL trace; imports flydsl lazily so this module imports anywhere)
# ------------------------------------------------------------------------------------------------
class _Emitter:
    def __init__(self, cfg: RocmKernelConfig, dialects=None):
        if dialects is None:  # FlyDSL's MLIR bindings; tests pass a numpy interpreter with the same API
            from flydsl._mlir import ir
            from flydsl._mlir.dialects import arith, gpu, llvm, rocdl, scf, vector
        else:
            ir, arith, gpu, llvm, rocdl, scf, vector = dialects

        self.cfg = cfg
        self.ir, self.arith, self.gpu, self.llvm, self.rocdl, self.scf, self.vector = (
            ir, arith, gpu, llvm, rocdl, scf, vector)
        self.i1 = ir.IntegerType.get_signless(1)
        self.i8 = ir.IntegerType.get_signless(8)
        self.i16 = ir.IntegerType.get_signless(16)
        self.i32 = ir.IntegerType.get_signless(32)
        self.i64 = ir.IntegerType.get_signless(64)
        self.f32 = ir.F32Type.get()
        self.f16 = ir.F16Type.get()
        self.ptr0 = ir.Type.parse("!llvm.ptr")
        self.ptr1 = ir.Type.parse("!llvm.ptr<1>")
        self.ptr8 = ir.Type.parse("!llvm.ptr<8>")

    # ---- scalars ----
    def c(self, v: int, ty=None):
        ty = ty or self.i32
        if ty == self.f32:
            return self.arith.ConstantOp(ty, self.ir.FloatAttr.get(ty, float(v))).result
        width = self.ir.IntegerType(ty).width
        v = int(v) & ((1 << width) - 1)
        if v >= 1 << (width - 1):
            v -= 1 << width
        return self.arith.ConstantOp(ty, self.ir.IntegerAttr.get(ty, v)).result

    def add(self, a, b):
        return self.arith.addi(a, b)

    def sub(self, a, b):
        return self.arith.subi(a, b)

    def mul(self, a, b):
        return self.arith.muli(a, b)

    def band(self, a, b):
        return self.arith.andi(a, b)

    def bor(self, a, b):
        return self.arith.ori(a, b)

    def shl(self, a, b):
        return self.arith.shli(a, b)

    def lshr(self, a, b):
        return self.arith.shrui(a, b)

    def cmp(self, pred: str, a, b):
        P = self.arith.CmpIPredicate
        return self.arith.cmpi(getattr(P, pred), a, b)

    def sel(self, c, a, b):
        return self.arith.select(c, a, b)

    def and1(self, a, b):
        return self.arith.andi(a, b)

    def i32c(self, v):
        return self.c(v, self.i32)

    def i64c(self, v):
        return self.c(v, self.i64)

    def ext64(self, v):
        return self.arith.extui(self.i64, v)

    def sext64(self, v):
        return self.arith.extsi(self.i64, v)

    def trunc32(self, v):
        return self.arith.trunci(self.i32, v)

    def bitcast(self, ty, v):
        return self.arith.bitcast(ty, v)

    # ---- memory ----
    def rsrc(self, addr_i64, nbytes_i64):
        """Buffer descriptor over [addr, addr + nbytes) (nbytes clamped to 32 bits: the lowering
        refuses larger buffers, see the module docstring's 32-bit limits)."""
        base = self.llvm.inttoptr(self.ptr0, addr_i64)
        n = self.arith.minui(nbytes_i64, self.i64c(0xFFFFFFFF))
        flags = self.i32c((7 << 12) | (4 << 15))  # CDNA: DATA_FORMAT 32, NUM_FORMAT float; raw
        return self.rocdl.make_buffer_rsrc(self.ptr8, base, self.c(0, self.i16), n, flags)

    def _raw_type(self, nbytes: int):
        if nbytes == 1:
            return self.i8
        if nbytes == 2:
            return self.i16
        if nbytes == 4:
            return self.i32
        assert nbytes % 4 == 0 and nbytes <= 16, nbytes
        return self.ir.VectorType.get([nbytes // 4], self.i32)

    @staticmethod
    def _pieces(nbytes: int) -> list[int]:
        out = []
        while nbytes > 0:
            p = min(16, nbytes)
            if p not in (1, 2, 4, 8, 12, 16):
                p = 8 if p > 8 else (4 if p > 4 else p)
            out.append(p)
            nbytes -= p
        return out

    def buf_load_words(self, rsrc, off_i32, nbytes: int) -> list:
        """Loads nbytes at byte offset off; returns raw pieces (i8/i16/i32/vector<Nxi32>)."""
        res, pos = [], 0
        for p in self._pieces(nbytes):
            o = off_i32 if pos == 0 else self.add(off_i32, self.i32c(pos))
            res.append((p, self.rocdl.raw_ptr_buffer_load(self._raw_type(p), rsrc, o, self.i32c(0))))
            pos += p
        return res

    def buf_store_pieces(self, pieces, rsrc, off_i32):
        pos = 0
        for p, val in pieces:
            o = off_i32 if pos == 0 else self.add(off_i32, self.i32c(pos))
            self.rocdl.raw_ptr_buffer_store(val, rsrc, o, self.i32c(0))
            pos += p

    def global_store_pieces(self, pieces, addr_i64):
        pos = 0
        for p, val in pieces:
            a = addr_i64 if pos == 0 else self.add(addr_i64, self.i64c(pos))
            ptr = self.llvm.inttoptr(self.ptr1, a)
            self.llvm.StoreOp(val, ptr, alignment=min(p, 16))
            pos += p

    def piece_words(self, pieces) -> list:
        """Raw pieces -> list of (bytes, i32/i16/i8 scalar) in memory order."""
        out = []
        for p, val in pieces:
            if p <= 4:
                out.append((p, val))
            else:
                for j in range(p // 4):
                    out.append((4, self.vector.extract(val, [], [j])))
        return out

    def words_to_pieces(self, words: list) -> list:
        """list of (bytes, scalar) in memory order, total a multiple of the piece sizes -> pieces."""
        nbytes = sum(b for b, _ in words)
        if nbytes < 4:
            assert len(words) == 1
            return words
        pieces, i = [], 0
        for p in self._pieces(nbytes):
            group = []
            got = 0
            while got < p:
                group.append(words[i][1])
                got += words[i][0]
                i += 1
            if p == 4:
                pieces.append((4, group[0]))
            else:
                vt = self.ir.VectorType.get([p // 4], self.i32)
                pieces.append((p, self.vector.from_elements(vt, group)))
        return pieces

    # ---- element conversions ----
    def elems_from_pieces(self, pieces, code: int, n: int) -> list:
        """Raw loaded pieces holding n elements of dtype `code` -> n f32 values."""
        words = self.piece_words(pieces)
        vals = []
        for b, w in words:
            if code == F32:
                vals.append(self.bitcast(self.f32, w))
                continue
            w32 = w if b == 4 else self.arith.extui(self.i32, w)
            for k in range(b // 2):
                h = self.lshr(w32, self.i32c(16 * k)) if k else w32
                if code == BF16:
                    bits = self.shl(h, self.i32c(16)) if k == 0 else self.band(w32, self.i32c(0xFFFF0000))
                    vals.append(self.bitcast(self.f32, bits))
                else:
                    h16 = self.arith.trunci(self.i16, h)
                    vals.append(self.arith.extf(self.f32, self.bitcast(self.f16, h16)))
        assert len(vals) == n, (len(vals), n)
        return vals

    def is_nan_bits(self, u):
        return self.cmp("ugt", self.band(u, self.i32c(0x7FFFFFFF)), self.i32c(0x7F800000))

    def f32_to_bf16_bits(self, f):
        u = self.bitcast(self.i32, f)
        r = self.lshr(self.add(self.add(u, self.i32c(0x7FFF)), self.band(self.lshr(u, self.i32c(16)), self.i32c(1))),
                      self.i32c(16))
        return self.sel(self.is_nan_bits(u), self.i32c(0x7FFF), r)  # canonical NaN

    def f32_to_f16_bits(self, f):
        u = self.bitcast(self.i32, f)
        h = self.arith.extui(self.i32, self.bitcast(self.i16, self.arith.truncf(self.f16, f)))
        return self.sel(self.is_nan_bits(u), self.i32c(0x7FFF), h)  # canonical NaN

    def canonical_f32_bits(self, f):
        u = self.bitcast(self.i32, f)
        return self.sel(self.is_nan_bits(u), self.i32c(0x7FFFFFFF), u)

    def inv_scale(self, scale):
        """rc_inv_scale: r32(1 / scale), +-inf replaced by +-FLT_MAX."""
        u = self.bitcast(self.i32, self.arith.divf(self.c(1, self.f32), scale))
        sign = self.band(u, self.i32c(0x80000000))
        is_inf = self.cmp("eq", self.band(u, self.i32c(0x7FFFFFFF)), self.i32c(0x7F800000))
        return self.bitcast(self.f32, self.sel(is_inf, self.bor(sign, self.i32c(0x7F7FFFFF)), u))

    def round_to(self, f, code: int):
        """f32 value rounded to dtype `code` and back (native precision)."""
        if code == BF16:
            return self.bitcast(self.f32, self.shl(self.f32_to_bf16_bits(f), self.i32c(16)))
        if code == F16:
            return self.arith.extf(self.f32, self.arith.truncf(self.f16, f))
        return f

    def _rne_shift(self, m, s):
        """m >> s rounded to nearest even; s an i32 value in [1, 31]."""
        kept = self.lshr(m, s)
        one = self.i32c(1)
        rem = self.band(m, self.sub(self.shl(one, s), one))
        half = self.shl(one, self.sub(s, one))
        up = self.arith.ori(self.cmp("ugt", rem, half),
                            self.and1(self.cmp("eq", rem, half), self.cmp("ne", self.band(kept, one), self.i32c(0))))
        return self.add(kept, self.arith.extui(self.i32, up))

    def f32_to_fp8_bits(self, f, fnuz: bool):
        """rc_f32_to_fp8 of rope_cache_math.h (saturating e4m3fn / e4m3fnuz, RNE)."""
        c = self.i32c
        x0 = self.bitcast(self.i32, f)
        sign = self.band(self.lshr(x0, c(24)), c(0x80))
        x = self.band(x0, c(0x7FFFFFFF))
        bias = 8 if fnuz else 7
        max_code = 0x7F if fnuz else 0x7E
        e = self.lshr(x, c(23))
        # normal e4m3 range
        rebased = self.sub(x, c((127 - bias) << 23))
        code_n = self._rne_shift(rebased, c(20))
        code_n = self.sel(self.cmp("ugt", e, c(127 + 9)), c(max_code + 1), code_n)
        code_n = self.arith.minui(code_n, c(max_code))
        # subnormal e4m3 range: shift = 148 - bias - e, clamped to [1, 31] for the shift itself
        shift = self.sub(c(148 - bias), e)
        sh = self.arith.minui(self.arith.maxsi(shift, c(1)), c(31))
        mant = self.bor(self.band(x, c(0x7FFFFF)), c(0x800000))
        code_s = self._rne_shift(mant, sh)
        zero_s = self.arith.ori(self.cmp("sgt", shift, c(25)), self.cmp("eq", e, c(0)))
        code_s = self.sel(zero_s, c(0), code_s)
        code = self.sel(self.cmp("uge", e, c(128 - bias)), code_n, code_s)
        out = self.bor(sign, code)
        if fnuz:
            out = self.sel(self.cmp("eq", code, c(0)), c(0), out)
        nan = c(0x80 if fnuz else 0x7F)  # canonical NaN
        return self.sel(self.cmp("ugt", x, c(0x7F800000)), nan, out)

    def f32_to_e5m2_bits(self, f):
        """rc_f32_to_e5m2 of rope_cache_math.h (saturating e5m2, RNE; NaN 0x7F, -0 kept). Integer
        arithmetic on both archs: gfx942's bf8 conversions write e5m2fnuz (bias 16), and gfx950's
        OCP ones are not used so that both archs run the same code."""
        c = self.i32c
        x0 = self.bitcast(self.i32, f)
        sign = self.band(self.lshr(x0, c(24)), c(0x80))
        x = self.band(x0, c(0x7FFFFFFF))
        e = self.lshr(x, c(23))
        # normal e5m2 range (e >= 113): rebias 127 -> 15, keep 2 mantissa bits, saturate at 0x7B
        code_n = self.arith.minui(self._rne_shift(self.sub(x, c(112 << 23)), c(21)), c(0x7B))
        # subnormal e5m2 range: shift = 134 - e, clamped to [1, 31] for the shift itself
        shift = self.sub(c(134), e)
        sh = self.arith.minui(self.arith.maxsi(shift, c(1)), c(31))
        mant = self.bor(self.band(x, c(0x7FFFFF)), c(0x800000))
        code_s = self._rne_shift(mant, sh)
        zero_s = self.arith.ori(self.cmp("sgt", shift, c(25)), self.cmp("eq", e, c(0)))
        code_s = self.sel(zero_s, c(0), code_s)
        code = self.sel(self.cmp("uge", e, c(113)), code_n, code_s)
        out = self.bor(sign, code)
        return self.sel(self.cmp("ugt", x, c(0x7F800000)), c(0x7F), out)  # canonical NaN

    def f32_to_int_bits(self, y, q: int, mask: int):
        """clamp(round_half_even(y), -q, q) as two's complement bits & mask, NaN -> 0 (reference.quantize_rows
        of a low-bit cache). On the bits: |y| above q (+-inf too) saturates by its sign; otherwise
        y + 1.5 * 2^23 rounds y to an integer (nearest even, |y| <= q < 2^22) in its low mantissa bits."""
        c = self.i32c
        u = self.bitcast(self.i32, y)
        a = self.band(u, c(0x7FFFFFFF))
        qb = struct.unpack("<I", struct.pack("<f", float(q)))[0]
        rounded = self.sub(self.bitcast(self.i32, self.arith.addf(y, self.c(12582912.0, self.f32))), c(0x4B400000))
        sat = self.sel(self.cmp("ne", self.lshr(u, c(31)), c(0)), c(-q), c(q))
        out = self.sel(self.cmp("ugt", a, c(qb)), sat, rounded)
        out = self.sel(self.cmp("ugt", a, c(0x7F800000)), c(0), out)  # NaN
        return self.band(out, c(mask))

    def int4_bytes(self, nibbles: list) -> list:
        """Byte bits (i32) of nibble pairs: nibbles[2j] | nibbles[2j + 1] << 4."""
        assert len(nibbles) % 2 == 0, len(nibbles)
        return [self.bor(nibbles[j], self.shl(nibbles[j + 1], self.i32c(4))) for j in range(0, len(nibbles), 2)]

    def pack_bits(self, bits: list, elem_bytes: int) -> list:
        """Element bit patterns (i32 each, low bits used) -> list of (bytes, word) for storing."""
        per = 4 // elem_bytes if elem_bytes < 4 else 1
        n = len(bits)
        if elem_bytes * n < 4:  # 1 or 2 bytes in total
            tot = elem_bytes * n
            w = bits[0]
            for k in range(1, n):
                w = self.bor(w, self.shl(bits[k], self.i32c(8 * elem_bytes * k)))
            return [(tot, self.arith.trunci(self.i8 if tot == 1 else self.i16, w))]
        words = []
        for j in range(0, n, per):
            w = bits[j]
            for k in range(1, per):
                w = self.bor(w, self.shl(bits[j + k], self.i32c(8 * elem_bytes * k)))
            words.append((4, w))
        return words

    def bits_to_f32(self, bits, code: int):
        """The f32 value of an element's bits (i32, low bits used) of dtype `code` (exact)."""
        if code == F32:
            return self.bitcast(self.f32, bits)
        if code == BF16:
            return self.bitcast(self.f32, self.shl(bits, self.i32c(16)))
        return self.arith.extf(self.f32, self.bitcast(self.f16, self.arith.trunci(self.i16, bits)))

    def to_bits(self, f, code: int, inv_scale=None):
        if code == F32:
            return self.canonical_f32_bits(f)
        if code == BF16:
            return self.f32_to_bf16_bits(f)
        if code == F16:
            return self.f32_to_f16_bits(f)
        if code == FP8_E5M2:
            return self.f32_to_e5m2_bits(self.arith.mulf(f, inv_scale))
        if code == INT8:
            return self.f32_to_int_bits(self.arith.mulf(f, inv_scale), 127, 0xFF)
        if code == INT4 and self.cfg.block_fmt:  # E2M1 codes, inv_scale the block's multiplier
            return self.e2m1_code(self.arith.mulf(f, inv_scale))
        if code == INT4:
            return self.f32_to_int_bits(self.arith.mulf(f, inv_scale), 7, 0xF)
        return self.f32_to_fp8_bits(self.arith.mulf(f, inv_scale), code == FP8_FNUZ)

    def store_elems_pieces(self, vals: list, code: int, inv_scale=None) -> list:
        if isinstance(inv_scale, list):  # block formats: a multiplier per value
            bits = [self.to_bits(v, code, m) for v, m in zip(vals, inv_scale)]
        else:
            bits = [self.to_bits(v, code, inv_scale) for v in vals]
        if code == INT4:  # channel 2j in the low nibble: one byte per pair
            bits = self.int4_bytes(bits)
        return self.words_to_pieces(self.pack_bits(bits, ITEMSIZE[code]))

    def zero_raw(self, nbytes: int):
        """A zero piece of the type buf_load_words gives nbytes."""
        if nbytes <= 4:
            return self.c(0, self._raw_type(nbytes))
        return self.vector.from_elements(self._raw_type(nbytes), [self.i32c(0)] * (nbytes // 4))

    # ---- cross-lane (wave64) ----
    def lane_xor(self, v, mask: int, tid):
        """f32 v of lane (lane ^ mask), as the xor butterfly of tree_sum uses it: masks 1, 2, 4, ...
        in that order, so a value is already equal across aligned groups of `mask` lanes. Masks 1, 2:
        DPP quad_perm; 4, 8: DPP row_half_mirror / row_mirror (lane 7-i / 15-i: the same value as
        lane i^4 / i^8 given that equality); 16: ds_swizzle (bitmask mode, xor 16 within 32 lanes);
        32: ds_bpermute."""
        return self.bitcast(self.f32, self.lane_xor_bits(self.bitcast(self.i32, v), mask, tid))

    def lane_xor_bits(self, i, mask: int, tid):
        """lane_xor of an i32 value."""
        if mask in (1, 2, 4, 8):
            ctrl = {1: 0xB1, 2: 0x4E, 4: 0x141, 8: 0x140}[mask]
            r = self.rocdl.update_dpp(self.i32, self.i32c(0), i, ctrl, 0xF, 0xF, True)
        elif mask == 16:
            r = self.rocdl.ds_swizzle(self.i32, i, self.i32c(0x1F | (0x10 << 10)))
        else:
            assert mask == 32, mask
            addr = self.shl(self.band(self.arith.xori(tid, self.i32c(32)), self.i32c(63)), self.i32c(2))
            r = self.rocdl.ds_bpermute(self.i32, addr, i)
        return r

    def token_scale_row(self, vals: list, lanes: int, tid):
        """(scale, r32(1 / scale)) of a row whose f32 values `vals` (this lane's share) are spread
        over an aligned group of `lanes` lanes (a power of two, one wave): reference.token_scale.
        The absolute maximum is taken on bits (|x| with the sign cleared orders as an unsigned
        integer; NaN and +-inf count as 0), so it is exact and the reduction order is free: a max
        over the lane's values, then the xor butterfly of lane_xor; then the floor, and the scale
        by a correctly rounded f32 division."""
        c = self.i32c
        amax = None
        for v in vals:
            a = self.band(self.bitcast(self.i32, v), c(0x7FFFFFFF))
            a = self.sel(self.cmp("ult", a, c(0x7F800000)), a, c(0))
            amax = a if amax is None else self.arith.maxui(amax, a)
        m = 1
        while m < lanes:
            amax = self.arith.maxui(amax, self.lane_xor_bits(amax, m, tid))
            m *= 2
        amax = self.arith.maxui(amax, c(TOKEN_AMAX_FLOOR_BITS))
        q = FP8_MAX.get(self.cfg.cache_dt) or QUANT_MAX[self.cfg.cache_dt]
        scale = self.arith.divf(self.bitcast(self.f32, amax), self.c(q, self.f32))
        return scale, self.inv_scale(scale)

    # ---- NVFP4 / MXFP4 (reference.quantize_blocks) ----
    def amax_bits(self, vals: list):
        """max |x| over vals as bits (NaN and +-inf count as 0): an unsigned max (token_scale_row)."""
        c = self.i32c
        amax = None
        for v in vals:
            a = self.band(self.bitcast(self.i32, v), c(0x7FFFFFFF))
            a = self.sel(self.cmp("ult", a, c(0x7F800000)), a, c(0))
            amax = a if amax is None else self.arith.maxui(amax, a)
        return amax

    def e4m3_to_f32(self, b):
        """The f32 value of E4M3 bits b (i32, low byte): exact (subnormals as (1 + m/8) 2^-6 - 2^-6)."""
        c = self.i32c
        e, m = self.band(self.lshr(b, c(3)), c(0xF)), self.band(b, c(7))
        sign = self.shl(self.band(b, c(0x80)), c(24))
        normal = self.bitcast(self.f32, self.bor(self.shl(self.add(e, c(120)), c(23)), self.shl(m, c(20))))
        sub = self.arith.subf(self.bitcast(self.f32, self.bor(c(121 << 23), self.shl(m, c(20)))),
                              self.c(2.0 ** -6, self.f32))
        mag = self.bitcast(self.i32, self.sel(self.cmp("eq", e, c(0)), sub, normal))
        mag = self.sel(self.cmp("eq", self.band(b, c(0x7F)), c(0x7F)), c(0x7FC00000), mag)  # NaN
        return self.bitcast(self.f32, self.bor(mag, sign))

    def block_scale(self, amax, g=None, enc=None):
        """(scale byte (i32), multiplier f32) of a block of absolute maximum bits `amax`: NVFP4 with the
        global decode scale g and enc = r32(1 / g) (nvfp4_scales, nvfp4_multiplier), else MXFP4's E8M0
        exponent and 2^-X (mxfp4_exponents)."""
        c = self.i32c
        if self.cfg.block_fmt == MXFP4:
            x = self.arith.maxsi(self.sub(self.lshr(amax, c(23)), c(129)), c(-127))  # floor(log2) - 2, >= -127
            return self.add(x, c(127)), self.bitcast(self.f32, self.shl(self.sub(c(127), x), c(23)))
        s = self.arith.mulf(self.arith.divf(self.bitcast(self.f32, amax), self.c(6.0, self.f32)), enc)
        u = self.bitcast(self.i32, s)
        mag = self.band(u, c(0x7FFFFFFF))
        top = struct.unpack("<I", struct.pack("<f", 448.0))[0]
        clip = self.sel(self.cmp("ugt", mag, c(top)), c(top), u)
        clip = self.sel(self.and1(self.cmp("ne", self.lshr(u, c(31)), c(0)), self.cmp("ne", mag, c(0))), c(0), clip)
        clip = self.sel(self.cmp("ugt", mag, c(0x7F800000)), u, clip)  # np.clip keeps NaN (and -0)
        byte = self.f32_to_fp8_bits(self.bitcast(self.f32, clip), False)
        den = self.arith.mulf(self.e4m3_to_f32(byte), g)
        inv = self.bitcast(self.i32, self.arith.divf(self.c(1, self.f32), den))
        inv = self.sel(self.cmp("eq", inv, c(0x7F800000)), c(0x7F7FFFFF), inv)  # min(1 / den, FLT_MAX)
        zero = self.cmp("eq", self.band(self.bitcast(self.i32, den), c(0x7FFFFFFF)), c(0))
        return byte, self.bitcast(self.f32, self.sel(zero, c(0), inv))

    def e2m1_code(self, p):
        """reference.e2m1_codes of f32 p: the thresholds compared on |p|'s bits (round half to even, +-6
        and +-inf saturating), the sign kept, NaN -> 0."""
        c = self.i32c
        u = self.bitcast(self.i32, p)
        a = self.band(u, c(0x7FFFFFFF))
        code = c(0)
        for t, up in ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                      (5.0, False)):
            tb = struct.unpack("<I", struct.pack("<f", t))[0]
            code = self.add(code, self.sel(self.cmp("uge" if up else "ugt", a, c(tb)), c(1), c(0)))
        code = self.bor(code, self.shl(self.lshr(u, c(31)), c(3)))
        return self.sel(self.cmp("ugt", a, c(0x7F800000)), c(0), code)

    def sqrt(self, f):
        """Correctly rounded f32 sqrt (llvm.sqrt without fast-math flags: the AMDGPU backend expands
        it to v_sqrt_f32 plus a correction step, not the 1-ulp instruction alone)."""
        return self.llvm.intr_sqrt(f)

    # ---- thread / block ----
    def tid(self):
        return self.arith.index_cast(self.i32, self.gpu.thread_id(self.gpu.Dimension.x))

    def bid(self):
        return self.arith.index_cast(self.i32, self.gpu.block_id(self.gpu.Dimension.x))

    def bid_y(self):
        return self.arith.index_cast(self.i32, self.gpu.block_id(self.gpu.Dimension.y))


def rotate_pairs(E, mode, native_dt, xa, xb, ca, sa, cb, sb):
    """(ya, yb) of pairs (a, b): a*cos_a - b*sin_a, b*cos_b + a*sin_b in the arithmetic `mode`
    (reference.rotate_values; rc_rotate_pair of rope_cache_math.h). Shared with the MLA kernel."""
    ya, yb = [], []
    for i in range(len(xa)):
        if mode == "fused":  # fma(a, cos_a, -(b*sin_a)), fma(b, cos_b, a*sin_b)
            neg = E.arith.negf(E.arith.mulf(xb[i], sa[i]))
            ya.append(E.llvm.intr_fma(xa[i], ca[i], neg))
            yb.append(E.llvm.intr_fma(xb[i], cb[i], E.arith.mulf(xa[i], sb[i])))
        elif native_dt is None:
            ya.append(E.arith.subf(E.arith.mulf(xa[i], ca[i]), E.arith.mulf(xb[i], sa[i])))
            yb.append(E.arith.addf(E.arith.mulf(xb[i], cb[i]), E.arith.mulf(xa[i], sb[i])))
        else:
            r = lambda v: E.round_to(v, native_dt)  # noqa: E731
            ya.append(r(E.arith.subf(r(E.arith.mulf(xa[i], ca[i])), r(E.arith.mulf(xb[i], sa[i])))))
            yb.append(r(E.arith.addf(r(E.arith.mulf(xb[i], cb[i])), r(E.arith.mulf(xa[i], sb[i])))))
    return ya, yb


def emit_kernel_body(cfg: RocmKernelConfig, args: list, dialects=None) -> None:
    """Emits the kernel body. `args`: the NUM_ARGS i64 kernel arguments as MLIR values.
    `dialects`: (ir, arith, gpu, llvm, rocdl, scf, vector) modules to emit with (default FlyDSL's)."""
    E = _Emitter(cfg, dialects)
    ir = E.ir
    c32, c64 = E.i32c, E.i64c
    NOPS = num_operands(cfg)
    (p_q, p_k, p_v, _p_kc, _p_vc, p_slot, p_pos, p_cos, p_sin, p_ks, p_vs, p_layer, p_wq, p_wk) = args[:NUM_OPERANDS]
    extra = list(args[NUM_OPERANDS:NOPS])  # contract.extra_operands: use_rope, temperature_factors
    p_use = extra.pop(0) if cfg.rope_switch else None
    p_temp = extra.pop(0) if cfg.temp_floor else None
    p_kgs, p_vgs = (extra.pop(0), extra.pop(0)) if cfg.block_fmt == NVFP4 else (None, None)  # global scales
    p_qo, p_ko, p_kco, p_vco = args[NOPS:NOPS + 4]
    p_ksc, p_vsc = args[NOPS + 4:NOPS + 6] if cfg.token_scales else (None, None)  # the scale caches
    dims = args[NOPS + num_results(cfg):kernel_args(cfg)]
    T, NB, MAXPOS = dims[0], dims[3], dims[7]

    s_in = ITEMSIZE[cfg.dt]
    s_tab = ITEMSIZE[cfg.tab_dt]
    s_c = ITEMSIZE[cfg.cache_dt]
    fp8 = cfg.cache_dt in FP8_CODES
    D, R, QH, KH, BS, X = cfg.d, cfg.r, cfg.qh, cfg.kh, cfg.bs, cfg.x
    PACK = 2 if cfg.cache_dt == INT4 else 1  # channels per stored cache element (int4: a byte holds 2)
    DC, XC = D // PACK, X * PACK  # a cache row's elements; the channels of one X group
    RH = QH + KH
    TPB = cfg.tpb
    tw = R if cfg.full_table else R // 2
    mode = arith_mode(cfg)
    native_dt = cfg.dt if mode == "rounded" else None
    WL = cfg.norm_type == WEIGHTLESS  # q and k normalised, no weights
    QN, KN = cfg.q_norm >= 0 or WL, cfg.k_norm >= 0 or WL
    GQ = 2 if cfg.q_gate else 1  # fused rows with the q gate: q head h at row 2h
    NL = norm_layout(cfg) if whole_rows(cfg) else None
    if cfg.token_scales:
        assert token_scales_problem(cfg) is None, token_scales_problem(cfg)
    assert block_problem(cfg) is None, block_problem(cfg)

    tid = E.tid()
    bid = E.bid()
    t0 = E.mul(E.ext64(bid), c64(TPB))                       # first token of this workgroup
    rows = E.arith.minsi(E.sub(T, t0), c64(TPB))              # valid tokens here (>= 1)

    def row_rsrc(ptr, row_bytes):
        base = E.add(ptr, E.mul(t0, c64(row_bytes)))
        return E.rsrc(base, E.mul(rows, c64(row_bytes)))

    if cfg.qkv:  # each of q, k, v the fused [T, QH + 2 KH, D]: a descriptor from each one's first head
        QKV_ROW = (GQ * QH + 2 * KH) * D * s_in

        def head_rsrc(ptr, first_head):
            skip = first_head * D * s_in
            return E.rsrc(E.add(ptr, E.add(E.mul(t0, c64(QKV_ROW)), c64(skip))),
                          E.sub(E.mul(rows, c64(QKV_ROW)), c64(skip)))

        rs_q, rs_k, rs_v = head_rsrc(p_q, 0), head_rsrc(p_k, GQ * QH), head_rsrc(p_v, GQ * QH + KH)
    else:
        rs_q = row_rsrc(p_q, QH * D * s_in)
        rs_k = row_rsrc(p_k, KH * D * s_in)
        rs_v = row_rsrc(p_v, KH * D * s_in)
    rs_qo = row_rsrc(p_qo, QH * D * s_in)
    rs_ko = row_rsrc(p_ko, KH * D * s_in)
    rs_slot = row_rsrc(p_slot, 8 if cfg.slot64 else 4)
    rs_pos = row_rsrc(p_pos, 8 if cfg.pos64 else 4)
    if cfg.mrope:  # positions [3, T]: stream s of the workgroup's tokens at rows s*T + t0 ...
        pes = 8 if cfg.pos64 else 4
        rs_pos_streams = [rs_pos] + [E.rsrc(E.add(p_pos, E.mul(E.add(E.mul(T, c64(st)), t0), c64(pes))),
                                            E.mul(rows, c64(pes))) for st in (1, 2)]
    tab_bytes = E.mul(MAXPOS, c64(tw * s_tab))
    rs_cos = E.rsrc(p_cos, tab_bytes)
    rs_sin = E.rsrc(p_sin, tab_bytes)
    rs_wq = E.rsrc(p_wq, c64(D * ITEMSIZE[cfg.q_norm])) if cfg.q_norm >= 0 else None
    rs_wk = E.rsrc(p_wk, c64(D * ITEMSIZE[cfg.k_norm])) if cfg.k_norm >= 0 else None
    # the rotation switch (uniform: one load per lane of the same word); nonzero rotates
    rot_on = (E.cmp("ne", E.rocdl.raw_ptr_buffer_load(E.i32, E.rsrc(p_use, c64(4)), c32(0), c32(0)), c32(0))
              if cfg.rope_switch else None)
    # the temperature factors: a descriptor over the operand's dim0 floats (a read past it gives 0)
    rs_temp = E.rsrc(p_temp, E.mul(dims[NOPS - 1], c64(4))) if cfg.temp_floor else None
    gscale = {}  # NVFP4: (g, r32(1 / g)) of the K and V global scales (uniform loads)
    for name, p_g in (("k", p_kgs), ("v", p_vgs)) if cfg.block_fmt == NVFP4 else ():
        g = E.bitcast(E.f32, E.rocdl.raw_ptr_buffer_load(E.i32, E.rsrc(p_g, c64(4)), c32(0), c32(0)))
        gscale[name] = (g, E.inv_scale(g))
    if cfg.nb:  # head_major: dims[3] is KH (or L); a layer's blocks are compiled in
        NB = c64(cfg.nb)
    num_slots, slot_base = E.mul(NB, c64(BS)), c64(0)
    if cfg.layer_blocks:  # stacked [L, NB, ...]: NB is static, L = dims[3]; a layer outside [0, L) writes nothing
        layer = E.sext64(E.rocdl.raw_ptr_buffer_load(E.i32, E.rsrc(p_layer, c64(4)), c32(0), c32(0)))
        layer_ok = E.and1(E.cmp("sge", layer, c64(0)), E.cmp("slt", layer, dims[3]))
        per_layer = c64(cfg.layer_blocks * BS)
        num_slots = E.sel(layer_ok, per_layer, c64(0))
        slot_base = E.sel(layer_ok, E.mul(layer, per_layer), c64(0))

    # fp8 scales: one inverse per kernel, or per kv head (the head's lanes compute it once per phase)
    rs_ks = rs_vs = inv_k1 = inv_v1 = None
    if fp8 and not cfg.token_scales:  # (per-token scales: computed per row, token_scale_row)
        rs_ks = E.rsrc(p_ks, c64(4 * KH if cfg.k_scale_heads else 4))
        rs_vs = E.rsrc(p_vs, c64(4 * KH if cfg.v_scale_heads else 4))
        if not cfg.k_scale_heads:
            inv_k1 = E.inv_scale(E.bitcast(E.f32, E.rocdl.raw_ptr_buffer_load(E.i32, rs_ks, c32(0), c32(0))))
        if not cfg.v_scale_heads:
            inv_v1 = E.inv_scale(E.bitcast(E.f32, E.rocdl.raw_ptr_buffer_load(E.i32, rs_vs, c32(0), c32(0))))

    def head_inv(rs, hh, one):
        """1/scale of kv head hh (i32, in [0, KH)), or the one scale."""
        if one is not None or not fp8:
            return one
        return E.inv_scale(E.bitcast(E.f32, E.rocdl.raw_ptr_buffer_load(E.i32, rs, E.mul(hh, c32(4)), c32(0))))

    def load_index(rs, tl, is64):
        """int64 value of an index array at local token tl (i32)."""
        if is64:
            pieces = E.buf_load_words(rs, E.mul(tl, c32(8)), 8)
            (_, w0), (_, w1) = E.piece_words(pieces)
            return E.bor(E.ext64(w0), E.shl(E.ext64(w1), c64(32)))
        (_, w), = E.buf_load_words(rs, E.mul(tl, c32(4)), 4)
        return E.sext64(w)

    def token_slot(tl, tvalid):
        """(write?, cache slot as i64 made safe (0 when not written)); stacked: the layer's slot."""
        s = load_index(rs_slot, tl, cfg.slot64)
        ok = E.and1(E.and1(E.cmp("sge", s, c64(0)), E.cmp("slt", s, num_slots)), tvalid)
        return ok, E.sel(ok, E.add(s, slot_base), c64(0))

    def head_major_row(s, hh):
        """head_major [.., KH, NB, BS, ..]: the (layer, kv head hh, block, offset) row of slot s (i64,
        counting the layers' slots one after the other: stacked, layer * NB * BS + slot)."""
        per = c64(cfg.nb * BS)
        layer = E.arith.divui(s, per)
        return E.add(E.mul(E.add(E.mul(layer, c64(KH)), hh), per), E.sub(s, E.mul(layer, per)))

    def row_el(s, hh, d, value: bool):
        """Element offset of channel d (i64) of kv head hh's row at slot s in head_major, or in
        kv_merged [.., NB, BS, 2 KH, D] (K head h at row 2h, V (`value`) at 2h + 1)."""
        if cfg.layout == HEAD_MAJOR:
            return E.add(E.mul(head_major_row(s, hh), c64(DC)), d)
        row = E.add(E.mul(s, c64(2 * KH)), E.add(E.mul(hh, c64(2)), c64(int(value))))
        return E.add(E.mul(row, c64(DC)), d)

    def k_cache_addr(s, h, d0: int | None, dvar=None):
        """Byte address in the key cache of element d of head h for slot s (i64)."""
        hh = c64(h) if isinstance(h, int) else E.ext64(h)
        if cfg.layout in (HEAD_MAJOR, KV_MERGED):
            el = row_el(s, hh, c64(d0) if dvar is None else dvar, False)
        elif cfg.layout == FLASH:
            el = E.mul(E.add(E.mul(s, c64(KH)), hh), c64(DC))
            el = E.add(el, c64(d0)) if dvar is None else E.add(el, dvar)
        elif cfg.layout == HND:
            blk = E.arith.divui(s, c64(BS))
            off = E.arith.remui(s, c64(BS))
            el = E.mul(E.add(E.mul(E.add(E.mul(blk, c64(KH)), hh), c64(BS)), off), c64(DC))
            el = E.add(el, c64(d0)) if dvar is None else E.add(el, dvar)
        else:
            blk = E.arith.divui(s, c64(BS))
            off = E.arith.remui(s, c64(BS))
            d = c64(d0) if dvar is None else dvar
            grp = E.arith.divui(d, c64(X))
            el = E.mul(E.add(E.mul(blk, c64(KH)), hh), c64(DC // X))
            el = E.add(el, grp)
            el = E.add(E.mul(el, c64(BS)), off)
            el = E.add(E.mul(el, c64(X)), E.arith.remui(d, c64(X)))
        return E.add(p_kco, E.mul(el, c64(s_c)))

    def v_cache_addr(s, hh64, d64):
        if cfg.layout in (HEAD_MAJOR, KV_MERGED):  # kv_merged: V rows in the key cache
            return E.add(p_kco if cfg.layout == KV_MERGED else p_vco, E.mul(row_el(s, hh64, d64, True), c64(s_c)))
        if cfg.layout == FLASH:
            el = E.add(E.mul(E.add(E.mul(s, c64(KH)), hh64), c64(DC)), d64)
        elif cfg.layout == HND:
            blk = E.arith.divui(s, c64(BS))
            off = E.arith.remui(s, c64(BS))
            el = E.add(E.mul(E.add(E.mul(E.add(E.mul(blk, c64(KH)), hh64), c64(BS)), off), c64(DC)), d64)
        else:
            blk = E.arith.divui(s, c64(BS))
            off = E.arith.remui(s, c64(BS))
            bh = E.add(E.mul(blk, c64(KH)), hh64)
            if cfg.layout == XPACKED:
                el = E.add(E.mul(E.add(E.mul(bh, c64(DC)), d64), c64(BS)), off)
            else:
                el = E.add(E.mul(bh, c64(BS // X)), E.arith.divui(off, c64(X)))
                el = E.add(E.mul(E.add(E.mul(el, c64(DC)), d64), c64(X)), E.arith.remui(off, c64(X)))
        return E.add(p_vco, E.mul(el, c64(s_c)))

    def guarded(cond, fn):
        op = E.scf.IfOp(cond)
        with ir.InsertionPoint(op.then_block):
            fn()
            E.scf.YieldOp([])

    def store_k_cache(s_ok, s, h_k, d0, vals, inv_k):
        """vals: f32 values of channels [d0, d0+len) of K head h_k (static d0 offset, var head)."""
        g = k_group(len(vals))

        def body():
            for m in range(0, len(vals), g):
                pieces = E.store_elems_pieces(vals[m:m + g], cfg.cache_dt,
                                              inv_k[m:m + g] if isinstance(inv_k, list) else inv_k)
                d = E.add(d0, c64(m)) if m else d0
                E.global_store_pieces(pieces, k_cache_addr(s, h_k, None, dvar=E.lshr(d, c64(1)) if PACK == 2 else d))
        guarded(s_ok, body)

    def store_row_scale(wr, c, s, h, scale, p_sc):
        """A row's scale (f32) into its scale cache [.., KH, BS] at (block, head h (i32), offset) of
        slot s, by the row's first lane (c == 0), where the row is written (wr)."""
        def body():
            if cfg.layout == HEAD_MAJOR:  # [.., KH, NB, BS]
                el = head_major_row(s, E.ext64(h))
            else:
                blk, off = E.arith.divui(s, c64(BS)), E.arith.remui(s, c64(BS))
                el = E.add(E.mul(E.add(E.mul(blk, c64(KH)), E.ext64(h)), c64(BS)), off)
            E.global_store_pieces([(4, E.bitcast(E.i32, scale))], E.add(p_sc, E.mul(el, c64(4))))
        guarded(E.and1(wr, E.cmp("eq", c, c32(0))), body)

    def store_block_scales(wr, c, s, h, fam_vals, fams, lanes_, p_sc, which):
        """NVFP4 / MXFP4: each block's scale of a row (the lane's values of each family, block_plan) into
        its block-scale cache row (the cache row's axes, D / G bytes), by the first lane holding the block,
        where the row is written (wr). Returns the per-value multipliers, per family."""
        g_ = BLOCK_GROUP[cfg.block_fmt]
        gs, enc = gscale.get(which, (None, None))
        hh = E.ext64(h)
        if cfg.layout == HEAD_MAJOR:
            row = head_major_row(s, hh)
        elif cfg.layout == FLASH:
            row = E.add(E.mul(s, c64(KH)), hh)
        else:
            row = E.add(E.mul(E.add(E.mul(E.arith.divui(s, c64(BS)), c64(KH)), hh), c64(BS)), E.arith.remui(s, c64(BS)))
        base = E.add(p_sc, E.mul(row, c64(D // g_)))
        mults = []
        for vals, (off, w) in zip(fam_vals, fams):
            n = block_plan(off, w, lanes_, g_)
            a = E.amax_bits(vals)
            m = 1
            while m < n:  # the block's lanes: an aligned group of n
                a = E.arith.maxui(a, E.lane_xor_bits(a, m, tid))
                m *= 2
            byte, mult = E.block_scale(a, gs, enc)
            idx = E.add(E.arith.divui(c, c32(n)), c32(off // g_))
            first = E.cmp("eq", E.arith.remui(c, c32(n)), c32(0))
            pieces = E.words_to_pieces(E.pack_bits([byte], 1))
            addr = E.add(base, E.ext64(idx))
            guarded(E.and1(wr, first), lambda pieces=pieces, addr=addr: E.global_store_pieces(pieces, addr))
            mults.append([mult] * len(vals))
        return mults

    def k_group(n):
        """Elements per key-cache store of a chunk of n channels (starting at a multiple of n): the
        chunk, or one X group of it where an x-packed X is narrower."""
        return XC if cfg.packed and XC < n else n

    def store_k_same(s_ok, s, h_k, d0, pieces, n):
        """A chunk of n channels already in the cache dtype (raw pieces) into the key cache, one
        store per X group where X < n (the bits as they are)."""
        g = k_group(n)
        if g == n:
            guarded(s_ok, lambda: E.global_store_pieces(pieces, k_cache_addr(s, h_k, None, dvar=d0)))
            return
        gb = g * s_c
        words = E.piece_words(pieces)
        if gb < 4:  # 2-byte groups of 16-bit elements: the halves of each word
            halves = []
            for _, w in words:
                halves += [E.arith.trunci(E.i16, w), E.arith.trunci(E.i16, E.lshr(w, c32(16)))]
            groups = [[(2, hw)] for hw in halves]
        else:
            per = gb // 4
            groups = [words[i:i + per] for i in range(0, len(words), per)]

        def body():
            for m, grp in enumerate(groups):
                addr = k_cache_addr(s, h_k, None, dvar=E.add(d0, c64(m * g)) if m else d0)
                E.global_store_pieces(E.words_to_pieces(grp), addr)
        guarded(s_ok, body)

    def lanes(cpx, nh):
        hp, ts = phase_geometry(cpx, nh, cfg.nt)
        c = E.arith.remui(tid, c32(cpx))
        hs = E.arith.remui(E.arith.divui(tid, c32(cpx)), c32(hp))
        tsl = E.arith.divui(tid, c32(cpx * hp))
        active_all = cpx * hp * ts >= cfg.nt
        return hp, ts, c, hs, tsl, active_all

    part = E.bid_y() if cfg.split > 1 else None  # a split configuration: the phase this workgroup runs

    def run_phase(name, cpx, nh, per_token, head_setup=None, setup=None):
        """Calls per_token(tl, tvalid, c, heads, ctx) for each token iteration; heads: [(h, hvalid,
        head_setup(h, hvalid))], ctx = setup(c): per-lane values made once, before the tokens.
        Split: only in the workgroups of part phases(cfg).index(name) (a uniform branch)."""
        if part is not None:
            guarded(E.cmp("eq", part, c32(phases(cfg).index(name))),
                    lambda: phase_body(cpx, nh, per_token, head_setup, setup))
        else:
            phase_body(cpx, nh, per_token, head_setup, setup)

    def phase_body(cpx, nh, per_token, head_setup, setup):
        hp, ts, c, hs, tsl, active_all = lanes(cpx, nh)
        ctx = setup(c) if setup else None
        heads = []
        for j in range(-(-nh // hp)):
            h = E.add(hs, c32(j * hp)) if j else hs
            hvalid = None if (j + 1) * hp <= nh else E.cmp("slt", h, c32(nh))
            heads.append((h, hvalid, head_setup(h, hvalid) if head_setup else None))
        for it in range(-(-TPB // ts)):
            tl = E.add(tsl, c32(it * ts)) if it else tsl
            tvalid = E.cmp("slt", E.ext64(tl), rows)
            lane_ok = None if active_all and (it + 1) * ts <= TPB else E.cmp("slt", tsl, c32(min(ts, TPB - it * ts)))
            if lane_ok is None:
                per_token(tl, tvalid, c, heads, ctx)
            else:
                guarded(lane_ok, lambda: per_token(tl, tvalid, c, heads, ctx))

    def load_qk(is_q, oq, ok, nbytes):
        """nbytes of q (Q heads) or k (K heads): one load per lane, branch on the head kind (uniform
        per wave whenever QH is a multiple of the heads a wave covers)."""
        sizes = E._pieces(nbytes)
        op = E.scf.IfOp(is_q, [E._raw_type(p) for p in sizes], has_else=True)
        with ir.InsertionPoint(op.then_block):
            E.scf.YieldOp([v for _, v in E.buf_load_words(rs_q, oq, nbytes)])
        with ir.InsertionPoint(op.else_block):
            E.scf.YieldOp([v for _, v in E.buf_load_words(rs_k, ok, nbytes)])
        return list(zip(sizes, op.results))

    def store_qk(is_q, pieces, oq, ok):
        op = E.scf.IfOp(is_q, [], has_else=True)
        with ir.InsertionPoint(op.then_block):
            E.buf_store_pieces(pieces, rs_qo, oq)
            E.scf.YieldOp([])
        with ir.InsertionPoint(op.else_block):
            E.buf_store_pieces(pieces, rs_ko, ok)
            E.scf.YieldOp([])

    def head_offset(tl, h, nheads, ch0_bytes_i32):
        return E.add(E.mul(E.add(E.mul(tl, c32(nheads)), h), c32(D * s_in)), ch0_bytes_i32)

    def in_offset(tl, h, nheads, ch0_bytes_i32, q=False):
        """head_offset in an input (q, k or v; its descriptor starts at the workgroup's first token):
        the fused tensor's rows hold QH + 2 KH heads (2 QH + 2 KH with the q gate: q head h at 2h)."""
        if not cfg.qkv:
            return head_offset(tl, h, nheads, ch0_bytes_i32)
        return E.add(E.add(E.mul(tl, c32(QKV_ROW)), E.mul(h, c32((GQ if q else 1) * D * s_in))), ch0_bytes_i32)

    def qk_head(h):
        """(is a Q head, kv head index (garbage for Q heads), kv head made safe for indexing)."""
        is_q = E.cmp("slt", h, c32(QH))
        hk = E.sub(h, c32(QH))
        return is_q, hk, E.sel(is_q, c32(0), hk)

    def qk_head_setup(h, hvalid):
        if not fp8 or not cfg.k_scale_heads:
            return inv_k1
        return head_inv(rs_ks, qk_head(h)[2], None)

    def ld_qk(tl, h, hk, is_q, hvalid, chunk, nbytes=None):
        """(pieces, q offset, k offset) of chunk (first channel = base (i32) + extra (static), n
        channels) of head h's row; the static part stays an immediate offset of the access."""
        base, extra, n = chunk
        oq = head_offset(tl, h, QH, E.mul(base, c32(s_in)))
        ok = head_offset(tl, hk, KH, E.mul(base, c32(s_in)))
        iq, ik = (in_offset(tl, h, QH, E.mul(base, c32(s_in)), q=True), in_offset(tl, hk, KH, E.mul(base, c32(s_in)))) \
            if cfg.qkv else (oq, ok)  # the inputs' offsets (the fused rows), oq / ok the outputs'
        if extra:
            oq, ok = E.add(oq, c32(extra * s_in)), E.add(ok, c32(extra * s_in))
            if cfg.qkv:
                iq, ik = E.add(iq, c32(extra * s_in)), E.add(ik, c32(extra * s_in))
        nbytes = nbytes or n * s_in
        if hvalid is not None:
            big = c32(OOB_OFFSET)  # past the descriptor: the hardware returns 0, drops stores
            oq = E.sel(hvalid, oq, big)
            ok = E.sel(hvalid, ok, big)
            if cfg.qkv:
                iq, ik = E.sel(hvalid, iq, big), E.sel(hvalid, ik, big)
        if not cfg.qkv:
            iq, ik = oq, ok
        return load_qk(is_q, iq, ik, nbytes), oq, ok

    # ---- QK-RMSNorm pieces ----
    def norm_weights(chunks, is_q, convert=True):
        """The head's weights (q's or k's, by its kind) of `chunks` [(first channel (i32), n)]: a
        list of f32 lists. With both norms, one load per chunk picks the kind's weight (half the
        registers of holding both). convert=False (loaded early): a thunk giving those lists, the
        loaded words held packed until then where one weight dtype is loaded."""
        def load(rs, code, convert):
            sw = ITEMSIZE[code]
            out = []
            for base, extra, n in chunks:
                off = E.mul(base, c32(sw))
                pieces = E.buf_load_words(rs, E.add(off, c32(extra * sw)) if extra else off, n * sw)
                out.append(E.elems_from_pieces(pieces, code, n) if convert else pieces)
            return out

        if convert is False:  # (None: the raw pieces, for the thunk)
            if not (QN and KN) or cfg.q_norm == cfg.k_norm:
                raw = norm_weights(chunks, is_q, None)
                code = cfg.q_norm if QN else cfg.k_norm
                return lambda: [E.elems_from_pieces(p, code, n) for p, (_, _, n) in zip(raw, chunks)]
            vals = norm_weights(chunks, is_q)  # two weight dtypes: converted in the branch
            return lambda: vals
        if not (QN and KN):
            rs, code = (rs_wq, cfg.q_norm) if QN else (rs_wk, cfg.k_norm)
            return load(rs, code, convert is not None)
        same = cfg.q_norm == cfg.k_norm  # same dtype: select raw words, convert once
        if same:
            sizes = [[p for p in E._pieces(n * ITEMSIZE[cfg.q_norm])] for _, _, n in chunks]
            types = [E._raw_type(p) for sz in sizes for p in sz]
        else:
            types = [E.f32] * sum(n for _, _, n in chunks)
        op = E.scf.IfOp(is_q, types, has_else=True)
        for block, rs, code in ((op.then_block, rs_wq, cfg.q_norm), (op.else_block, rs_wk, cfg.k_norm)):
            with ir.InsertionPoint(block):
                got = load(rs, code, not same)
                E.scf.YieldOp([v for g in got for v in ([x for _, x in g] if same else g)])
        res, out, i = list(op.results), [], 0
        for (_, _, n), sz in zip(chunks, sizes if same else [None] * len(chunks)):
            if same:
                pieces = list(zip(sz, res[i:i + len(sz)]))
                i += len(sz)
                out.append(E.elems_from_pieces(pieces, cfg.q_norm, n) if convert else pieces)
            else:
                out.append(res[i:i + n])
                i += n
        return out

    always = E.cmp("sgt", T, c64(0))  # true whenever the kernel runs; the compiler cannot know

    def row_sum_sq(tl, h, hk, is_q, hvalid):
        """S of the whole row, loaded again by this lane (a layout the butterfly does not fit). The
        row's 16-byte pieces load one by one as the tree reaches them, each in its own (uniform)
        branch: only one piece is live next to the partial sums, not the whole row."""
        starts, e = [], 0
        for p in E._pieces(D * s_in):
            starts.append((e, p))
            e += p // s_in
        got = {}

        def elem_sq(i):
            k = max(j for j, (e0, _) in enumerate(starts) if e0 <= i)
            if k not in got:
                e0, p = starts[k]
                op = E.scf.IfOp(always, [E._raw_type(p)], has_else=True)
                with ir.InsertionPoint(op.then_block):
                    (_, v), = ld_qk(tl, h, hk, is_q, hvalid, (c32(0), e0, p // s_in))[0]
                    E.scf.YieldOp([v])
                with ir.InsertionPoint(op.else_block):
                    E.scf.YieldOp([E.zero_raw(p)])
                xs = E.elems_from_pieces([(p, op.results[0])], cfg.dt, p // s_in)
                got[k] = [E.arith.mulf(x, x) for x in xs]
            return got[k][i - starts[k][0]]

        def node(lo, n):
            if n == 1:
                return elem_sq(lo)
            if n % 2 == 0:
                return E.arith.addf(node(lo, n // 2), node(lo + n // 2, n // 2))
            return E.arith.addf(node(lo, n - 1), elem_sq(lo + n - 1))

        return node(0, D)

    def plan_sum_sq(fam_vals):
        sq = [[E.arith.mulf(x, x) for x in fv] for fv in fam_vals]
        if NL.plan == ("local",):  # in channel order (the families of a tail layout are not)
            order = sorted(range(len(sq)), key=lambda j: NL.families[j][0])
            return tree_sum([v for j in order for v in sq[j]], E.arith.addf)

        def ev(node):
            if node[0] == "add":
                return E.arith.addf(ev(node[1]), ev(node[2]))
            v = tree_sum(sq[node[1]], E.arith.addf)
            m = 1
            while m < NL.lanes:  # lanes c and c^m hold sibling nodes: their sum is the parent
                v = E.arith.addf(v, E.lane_xor(v, m, tid))
                m *= 2
            return v
        return ev(NL.plan)

    def norm_inv(S):
        """r32(1 / r32(sqrt(r32(r32(S / D) + eps))))."""
        if D & (D - 1) == 0:  # S * 2^-k rounds the same exact value as S / 2^k
            ms = E.arith.mulf(S, E.c(2.0 ** -(D.bit_length() - 1), E.f32))
        else:
            ms = E.arith.divf(S, E.c(float(D), E.f32))
        root = E.sqrt(E.arith.addf(ms, E.c(cfg.norm_eps, E.f32)))
        return E.arith.divf(E.c(1, E.f32), root)

    def head_normed(is_q):
        """i1 'this head is normalised', or None when every head is."""
        if QN and KN:
            return None
        return is_q if QN else E.arith.xori(is_q, E.c(1, E.i1))

    def normalized(raw, chunks, S, is_q, groups, ws_early=None):
        """(pieces, f32 values) per chunk of raw loaded pieces: n_i = r(r32(w_i * r(r32(x_i * inv))))
        for a normalised head (its bits, canonical NaN), x_i (the input's bits) for the others. One
        kind only: a branch on the kind yielding packed words (not selects, not f32 values: the
        other kind's lanes skip the norm and the merge costs the packed registers only).
        S: the row's sum, or None: from the chunks (groups: chunks per family of the plan).
        ws_early: norm_weights(.., convert=False) loaded with the chunks (else loaded here)."""
        ns = [ch[2] for ch in chunks]

        def compute():
            fam_x = [E.elems_from_pieces(p, cfg.dt, n) for p, n in zip(raw, ns)]
            if S is None:
                fam, i = [], 0
                for g in groups:
                    fam.append([v for xs in fam_x[i:i + g] for v in xs])
                    i += g
                inv = norm_inv(plan_sum_sq(fam))
            else:
                inv = norm_inv(S)
            if WL:  # reference.rms_norm "weightless": r(x * inv)
                bits = [[E.to_bits(E.arith.mulf(x, inv), cfg.dt) for x in xs] for xs in fam_x]
                return bits, [E.words_to_pieces(E.pack_bits(b, s_in)) for b in bits]
            # late (bandwidth): after the sum, so the weights are not live across it
            ws = ws_early() if ws_early else norm_weights(chunks, is_q)
            if cfg.norm_type == GEMMA:  # r((x * inv) * (1 + w)): one rounding
                one = E.c(1, E.f32)
                bits = [[E.to_bits(E.arith.mulf(E.arith.mulf(x, inv), E.arith.addf(one, w)), cfg.dt)
                         for x, w in zip(xs, wl)] for xs, wl in zip(fam_x, ws)]
            else:
                bits = [[E.to_bits(E.arith.mulf(w, E.round_to(E.arith.mulf(x, inv), cfg.dt)), cfg.dt)
                         for x, w in zip(xs, wl)] for xs, wl in zip(fam_x, ws)]
            return bits, [E.words_to_pieces(E.pack_bits(b, s_in)) for b in bits]

        normed = head_normed(is_q)
        if normed is None:
            bits, pieces = compute()
            return pieces, [[E.bits_to_f32(v, cfg.dt) for v in b] for b in bits]
        sizes = [[p for p, _ in pc] for pc in raw]
        op = E.scf.IfOp(normed, [E._raw_type(p) for sz in sizes for p in sz], has_else=True)
        with ir.InsertionPoint(op.then_block):
            E.scf.YieldOp([v for pc in compute()[1] for _, v in pc])
        with ir.InsertionPoint(op.else_block):
            E.scf.YieldOp([v for pc in raw for _, v in pc])
        res, pieces = list(op.results), []
        for sz in sizes:
            pieces.append(list(zip(sz, res[:len(sz)])))
            res = res[len(sz):]
        return pieces, [E.elems_from_pieces(p, cfg.dt, n) for p, n in zip(pieces, ns)]

    NORM_BEFORE = cfg.norm and not cfg.norm_after

    def select_pieces(cond, a, b):
        """Raw pieces a where cond (i1) holds, else b (the same piece sizes): bits, never values."""
        assert [n for n, _ in a] == [n for n, _ in b], (a, b)
        return [(n, E.sel(cond, va, vb)) for (n, va), (_, vb) in zip(a, b)]

    def temp_factor(tl):
        """The temperature factor (f32) of local token tl: temperature_factors[(clamp(p) + 1) // floor_scale],
        the index kept inside the operand (reference.temperature_rows)."""
        pos = load_index(rs_pos, tl, cfg.pos64)
        pos = E.arith.maxsi(E.arith.minsi(pos, E.sub(MAXPOS, c64(1))), c64(0))
        n = E.arith.divui(E.add(pos, c64(1)), c64(cfg.temp_floor))
        n = E.arith.maxsi(E.arith.minsi(n, E.sub(dims[NOPS - 1], c64(1))), c64(0))
        return E.bitcast(E.f32, E.rocdl.raw_ptr_buffer_load(E.i32, rs_temp, E.mul(E.trunc32(n), c32(4)), c32(0)))

    # ------------------------------ rotation phase ------------------------------
    W = cfg.w_rot
    cpx_rot = (R // 2) // W if cfg.neox else R // W
    merged = NL is not None and NL.merged
    early_w = cfg.latency and cfg.norm and not WL and NL is not None and NL.plan is not None
    npairs = W if cfg.neox else W // 2

    def rot_chunks(c):
        """[(first channel: base (i32) + extra (static), n)] of this lane's families: rotation
        chunks, then the merged pass-through sub-chunks."""
        cw = E.mul(c, c32(W))
        o = cfg.rot_lo  # 0, or D - R for the tail
        out = [(cw, o, W)]
        if cfg.neox:
            out.append((cw, o + R // 2, W))
        for off, w in (NL.families[NL.n_rot:] if merged else ()):
            base = E.mul(c, c32(w))
            out += [(base, off + i * NL.w_psub, NL.w_psub) for i in range(w // NL.w_psub)]
        return out

    def chunk_d0(chunk):
        base, extra, _ = chunk
        return E.add(E.ext64(base), c64(extra)) if extra else E.ext64(base)

    late_qk = cfg.norm_after or cfg.rope_switch  # q_out / k_out stored once the row's values are final

    def rot_token(tl, tvalid, c, heads, chunks):
        n_rot = 2 if cfg.neox else 1

        def table_row(rs):
            """Byte offset of the table row of the position at tl of `rs` (clamped in 64-bit; the offset
            is 32-bit: the lowering refuses tables of TABLE_BYTES_LIMIT bytes or more)."""
            pos = load_index(rs, tl, cfg.pos64)
            pos = E.arith.maxsi(E.arith.minsi(pos, E.sub(MAXPOS, c64(1))), c64(0))
            return E.mul(E.trunc32(pos), c32(tw * s_tab))

        if cfg.mrope:  # the row of every stream a frequency takes (each clamped on its own)
            stream_rows = {st: table_row(rs_pos_streams[st]) for st in sorted(set(mrope_streams(cfg)))}
        else:
            row = table_row(rs_pos)

        def tables():
            """(cos_a, sin_a, cos_b, sin_b) of this lane's pairs (f32, exact)."""
            if not cfg.mrope:
                return tables_at(row)
            # M-RoPE: one stream's chunk at a time, folded into the pairs that take it (one stream's
            # values in flight next to the result, not all three)
            order, take = mrope_selector(E, cfg, E.mul(c, c32(npairs)))
            nv = 4 if cfg.full_table else 2  # a "half" table: the b values are the a values
            acc = None
            for st in order:
                vals = tables_at(stream_rows[st])
                if acc is None:
                    acc = [list(v) for v in vals[:nv]]
                    continue
                for j in range(nv):
                    acc[j] = [E.sel(take(k, st), vals[j][k], acc[j][k]) for k in range(npairs)]
            return tuple(acc) if nv == 4 else (acc[0], acc[1], acc[0], acc[1])

        def tables_at(row):
            """tables() from the table row at byte offset `row`."""
            def tab(rs, first_elem, n):
                off = E.add(row, E.add(E.mul(c, c32(n * s_tab)), c32(first_elem * s_tab)))
                return E.elems_from_pieces(E.buf_load_words(rs, off, n * s_tab), cfg.tab_dt, n)  # exact

            if cfg.neox:
                ca = tab(rs_cos, 0, npairs)
                sa = tab(rs_sin, 0, npairs)
                if cfg.full_table:
                    cb = tab(rs_cos, R // 2, npairs)
                    sb = tab(rs_sin, R // 2, npairs)
                else:
                    cb, sb = ca, sa
            else:
                if cfg.full_table:
                    cf = tab(rs_cos, 0, W)
                    sf = tab(rs_sin, 0, W)
                    ca, cb = cf[0::2], cf[1::2]
                    sa, sb = sf[0::2], sf[1::2]
                else:
                    ca = tab(rs_cos, 0, npairs)
                    sa = tab(rs_sin, 0, npairs)
                    cb, sb = ca, sa
            return ca, sa, cb, sb

        # without a norm the tables load first; with one after it (not live across the reduction)
        tabs = None if NORM_BEFORE else tables()
        fac = temp_factor(tl) if cfg.temp_floor else None

        kslot = token_slot(tl, tvalid) if KH > 0 else None

        # loads first: every chunk of every head (and the whole row where the butterfly does not fit)
        loaded, early = [], []
        for h, hvalid, inv_k in heads:
            is_q, hk, _ = qk_head(h)
            got = [ld_qk(tl, h, hk, is_q, hvalid, ch) for ch in chunks]
            S = row_sum_sq(tl, h, hk, is_q, hvalid) if NORM_BEFORE and NL.plan is None else None
            # latency regime: the weights load with the chunks (one unit per lane: latency, not registers)
            early.append(norm_weights(chunks, is_q, convert=False) if early_w else None)
            loaded.append((h, hvalid, inv_k, is_q, hk, got, S))

        normed = []
        for (h, hvalid, inv_k, is_q, hk, got, S), ew in zip(loaded, early):
            if NORM_BEFORE:
                normed.append(normalized([g[0] for g in got], chunks, S, is_q, NL.groups, ew))
            else:
                normed.append((None, [E.elems_from_pieces(g[0], cfg.dt, ch[2]) for g, ch in zip(got, chunks)]))
        ca, sa, cb, sb = tabs or tables()

        for (h, hvalid, inv_k, is_q, hk, got, S), (new_pieces, fam_x), ew in zip(loaded, normed, early):
            if cfg.neox:
                xa, xb = fam_x[0], fam_x[1]
            else:
                xa, xb = fam_x[0][0::2], fam_x[0][1::2]
            ya, yb = rotate_pairs(E, mode, native_dt, xa[:npairs], xb[:npairs], ca, sa, cb, sb)
            # output values (rounded to the input dtype once)
            if cfg.neox:
                outs = [ya, yb]
            else:
                inter = []
                for i in range(npairs):
                    inter += [ya[i], yb[i]]
                outs = [inter]
            wr = None
            if KH > 0:
                s_ok, s = kslot
                wr = E.and1(s_ok, E.arith.xori(is_q, E.c(1, E.i1)))
                if hvalid is not None:
                    wr = E.and1(wr, hvalid)
            # q_out / k_out first (the same offsets as the loads; out-of-range ones are dropped),
            # then the key cache. Channels >= R held by this lane (norm on) are copied, normalised
            # where the head is.
            stores = []  # (pieces, values for another cache dtype, chunk)
            for j, (src, ch) in enumerate(zip(got, chunks)):
                if j < n_rot:
                    vals = outs[j]
                    pieces = E.store_elems_pieces(vals, cfg.dt)
                    # the cache stores k_out (rounded to the input dtype), converted to the cache dtype;
                    # an fp8 cache in "fused" arithmetic quantizes the f32 values before that rounding
                    if cfg.cache_dt != cfg.dt and not (cfg.dt == F32 or mode == "fused"):
                        vals = [E.round_to(v, cfg.dt) for v in vals]
                else:
                    vals, pieces = fam_x[j], (new_pieces[j] if new_pieces else src[0])
                if not late_qk:
                    store_qk(is_q, pieces, src[1], src[2])
                stores.append((pieces, vals, ch))
            if cfg.norm_after:  # the norm of the rotated row (q_out, k_out; the cache stores the rounded values)
                after, after_vals = normalized([p for p, _, _ in stores], chunks, None, is_q, NL.groups, ew)
                stores = [(p, v, ch) for p, v, ch in zip(after, after_vals, chunks)]
            if cfg.rope_switch:  # a call that does not rotate: the rows as they were (q times the factor)
                off = [(new_pieces[j] if new_pieces else src[0], fam_x[j]) for j, src in enumerate(got)]
                if cfg.temp_floor:
                    off = [(select_pieces(is_q, E.store_elems_pieces([E.arith.mulf(x, fac) for x in xs], cfg.dt), p),
                            xs) for p, xs in off]
                stores = [(select_pieces(rot_on, p, op), [E.sel(rot_on, v, ov) for v, ov in zip(vals, ovals)], ch)
                          for (p, vals, ch), (op, ovals) in zip(stores, off)]
            for (pieces, _, _), src in zip(stores if late_qk else (), got):
                store_qk(is_q, pieces, src[1], src[2])
            if KH == 0:
                continue
            per_chunk = None
            if cfg.block_fmt:  # the blocks' scales (every lane of the row), a multiplier per value
                fam_vals, j = [], 0
                for n in NL.groups:
                    fam_vals.append([v for _, vals, _ in stores[j:j + n] for v in vals])
                    j += n
                mults = store_block_scales(wr, c, s, hk, fam_vals, NL.families, NL.lanes, p_ksc, "k")
                per_chunk = []
                for n, mf in zip(NL.groups, mults):
                    step = len(mf) // n
                    per_chunk += [mf[i * step:(i + 1) * step] for i in range(n)]
            elif cfg.token_scales:  # the row's scale, from the values the cache quantizes (every lane of the row)
                scale, inv_k = E.token_scale_row([v for _, vals, _ in stores for v in vals], NL.lanes, tid)
                store_row_scale(wr, c, s, hk, scale, p_ksc)
            for j, (pieces, vals, ch) in enumerate(stores):
                d0 = chunk_d0(ch)
                if cfg.cache_dt == cfg.dt:
                    store_k_same(wr, s, hk, d0, pieces, ch[2])
                else:
                    store_k_cache(wr, s, hk, d0, vals, inv_k if per_chunk is None else per_chunk[j])

    if R:
        run_phase("rot", cpx_rot, RH, rot_token, head_setup=qk_head_setup, setup=rot_chunks)

    # ------------------------------ pass-through phase ------------------------------
    if R < D and not merged:
        WP = cfg.w_pass
        cpx_p = (D - R) // WP

        def pass_setup(c):
            return (E.mul(c, c32(WP)), cfg.pass_lo, WP)

        # R = 0 with a norm: the head's cpx_p lanes hold its row, one tree node each where they are a
        # power-of-two group of one wave: S by the xor butterfly (the other shapes reload the row)
        nope_butterfly = R == 0 and cfg.norm and cpx_p & (cpx_p - 1) == 0 and cpx_p <= 64

        def chunk_row_sum(pieces):
            xs = E.elems_from_pieces(pieces, cfg.dt, WP)
            v = tree_sum([E.arith.mulf(x, x) for x in xs], E.arith.addf)
            m = 1
            while m < cpx_p:  # lanes c and c^m hold sibling nodes
                v = E.arith.addf(v, E.lane_xor(v, m, tid))
                m *= 2
            return v

        def pass_token(tl, tvalid, c, heads, ch):
            kslot = token_slot(tl, tvalid)
            fac = temp_factor(tl) if cfg.temp_floor else None
            # q times the factor on calls that do not rotate (R = 0: every call)
            scaled = None
            if cfg.temp_floor:
                scaled = E.arith.xori(rot_on, E.c(1, E.i1)) if cfg.rope_switch else E.c(1, E.i1)
            loaded = []
            for h, hvalid, inv_k in heads:
                is_q, hk, _ = qk_head(h)
                got = ld_qk(tl, h, hk, is_q, hvalid, ch)
                if nope_butterfly:
                    S = chunk_row_sum(got[0])
                else:
                    S = row_sum_sq(tl, h, hk, is_q, hvalid) if cfg.norm else None
                loaded.append((h, hvalid, inv_k, is_q, hk, got, S))
            for h, hvalid, inv_k, is_q, hk, (pieces, oq, ok), S in loaded:
                vals = None
                if cfg.norm:
                    (pieces,), (vals,) = normalized([pieces], [ch], S, is_q, [1])
                if cfg.token_scales:  # R = 0: the head's lanes hold its K row (token_scales_problem)
                    s_ok, s = kslot
                    wr = E.and1(s_ok, E.arith.xori(is_q, E.c(1, E.i1)))
                    if hvalid is not None:
                        wr = E.and1(wr, hvalid)
                    vals = vals if vals is not None else E.elems_from_pieces(pieces, cfg.dt, WP)
                    if cfg.block_fmt:
                        inv_k, = store_block_scales(wr, c, s, hk, [vals], ((cfg.pass_lo, WP),), cpx_p, p_ksc, "k")
                    else:
                        scale, inv_k = E.token_scale_row(vals, cpx_p, tid)
                        store_row_scale(wr, c, s, hk, scale, p_ksc)
                if scaled is not None:
                    xs = vals if vals is not None else E.elems_from_pieces(pieces, cfg.dt, WP)
                    tp = E.store_elems_pieces([E.arith.mulf(x, fac) for x in xs], cfg.dt)
                    store_qk(is_q, select_pieces(E.and1(scaled, is_q), tp, pieces), oq, ok)
                else:
                    store_qk(is_q, pieces, oq, ok)
                s_ok, s = kslot
                wr = E.and1(s_ok, E.arith.xori(is_q, E.c(1, E.i1)))
                if hvalid is not None:
                    wr = E.and1(wr, hvalid)
                d0 = chunk_d0(ch)
                if cfg.cache_dt == cfg.dt:
                    store_k_same(wr, s, hk, d0, pieces, WP)
                else:
                    if vals is None:
                        vals = E.elems_from_pieces(pieces, cfg.dt, WP)
                    store_k_cache(wr, s, hk, d0, vals, inv_k)

        run_phase("pass", cpx_p, RH, pass_token, head_setup=qk_head_setup, setup=pass_setup)

    # ------------------------------ V phase ------------------------------
    WV = cfg.w_v
    cpx_v = D // WV

    def v_head_setup(h, hvalid):
        if not fp8 or not cfg.v_scale_heads:
            return inv_v1
        return head_inv(rs_vs, h if hvalid is None else E.sel(hvalid, h, c32(0)), None)

    def v_token(tl, tvalid, c, heads, ctx):
        s_ok, s = token_slot(tl, tvalid)
        for h, hvalid, inv_v in heads:
            cw = E.mul(c, c32(WV * s_in))
            off = in_offset(tl, h, KH, cw)
            if hvalid is not None:
                off = E.sel(hvalid, off, c32(OOB_OFFSET))
            pv = E.buf_load_words(rs_v, off, WV * s_in)
            wr = s_ok if hvalid is None else E.and1(s_ok, hvalid)
            d0 = E.ext64(E.mul(c, c32(WV)))
            hh = E.ext64(h)
            vals = None
            if cfg.token_scales:  # the row's scale (every lane of the row, outside the store's branch)
                vals = E.elems_from_pieces(pv, cfg.dt, WV)
                if cfg.block_fmt:
                    inv_v, = store_block_scales(wr, c, s, h, [vals], ((0, WV),), cpx_v, p_vsc, "v")
                else:
                    scale, inv_v = E.token_scale_row(vals, cpx_v, tid)
                    store_row_scale(wr, c, s, h, scale, p_vsc)

            def body(pv=pv, d0=d0, hh=hh, inv_v=inv_v, vals=vals):
                if not cfg.packed:  # rows of D channels
                    if cfg.cache_dt == cfg.dt:
                        pieces = pv
                    else:
                        vals = vals or E.elems_from_pieces(pv, cfg.dt, WV)
                        pieces = E.store_elems_pieces(vals, cfg.cache_dt, inv_v)
                    E.global_store_pieces(pieces, v_cache_addr(s, hh, E.lshr(d0, c64(1)) if PACK == 2 else d0))
                else:  # one element per row of the value cache
                    vals = vals or E.elems_from_pieces(pv, cfg.dt, WV)
                    bits = None  # other caches: each element converted just before its store (the emitted order)
                    if PACK == 2:  # one byte per channel pair, at element d / 2
                        bits = E.int4_bytes([E.to_bits(v, cfg.cache_dt, inv_v) for v in vals])
                        d0 = E.lshr(d0, c64(1))
                    for i in range(len(vals) if bits is None else len(bits)):
                        b = E.to_bits(vals[i], cfg.cache_dt, inv_v) if bits is None else bits[i]
                        words = E.pack_bits([b], s_c)
                        E.global_store_pieces(E.words_to_pieces(words), v_cache_addr(s, hh, E.add(d0, c64(i))))
            guarded(wr, body)

    run_phase("v", cpx_v, KH, v_token, head_setup=v_head_setup)


def build_launcher(cfg: RocmKernelConfig):
    """A @flyc.jit function (launch_args(cfg) Int64 arguments: NUM_ARGS, more with extra operands) that
    launches the kernel for `cfg`, which takes the first kernel_args(cfg) of them (32; 34 with per-token
    scales or one extra operand; 36, 38 with more)."""
    import flydsl.compiler as flyc
    import flydsl.expr as fx

    def _raw(v):
        return v.ir_value() if hasattr(v, "ir_value") else v

    n = kernel_args(cfg)
    if n == 38:  # extra operands (use_rope, temperature_factors)
        @flyc.kernel(known_block_size=(cfg.nt, 1, 1))
        def jrc_rope_cache(a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64,
                           a6: fx.Int64, a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64,
                           a12: fx.Int64, a13: fx.Int64, a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64,
                           a18: fx.Int64, a19: fx.Int64, a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64,
                           a24: fx.Int64, a25: fx.Int64, a26: fx.Int64, a27: fx.Int64, a28: fx.Int64, a29: fx.Int64,
                           a30: fx.Int64, a31: fx.Int64, a32: fx.Int64, a33: fx.Int64, a34: fx.Int64, a35: fx.Int64,
                           a36: fx.Int64, a37: fx.Int64):
            emit_kernel_body(cfg, [_raw(a) for a in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14,
                                                     a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27,
                                                     a28, a29, a30, a31, a32, a33, a34, a35, a36, a37)])
    elif n == 36:  # extra operands (use_rope, temperature_factors)
        @flyc.kernel(known_block_size=(cfg.nt, 1, 1))
        def jrc_rope_cache(a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64,
                           a6: fx.Int64, a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64,
                           a12: fx.Int64, a13: fx.Int64, a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64,
                           a18: fx.Int64, a19: fx.Int64, a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64,
                           a24: fx.Int64, a25: fx.Int64, a26: fx.Int64, a27: fx.Int64, a28: fx.Int64, a29: fx.Int64,
                           a30: fx.Int64, a31: fx.Int64, a32: fx.Int64, a33: fx.Int64, a34: fx.Int64, a35: fx.Int64):
            emit_kernel_body(cfg, [_raw(a) for a in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14,
                                                     a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, a26, a27,
                                                     a28, a29, a30, a31, a32, a33, a34, a35)])
    elif n == 34:
        @flyc.kernel(known_block_size=(cfg.nt, 1, 1))
        def jrc_rope_cache(a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64,
                           a6: fx.Int64, a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64,
                           a12: fx.Int64, a13: fx.Int64, a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64,
                           a18: fx.Int64, a19: fx.Int64, a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64,
                           a24: fx.Int64, a25: fx.Int64, a26: fx.Int64, a27: fx.Int64, a28: fx.Int64, a29: fx.Int64,
                           a30: fx.Int64, a31: fx.Int64, a32: fx.Int64, a33: fx.Int64):
            emit_kernel_body(cfg, [_raw(a) for a in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13,
                                                     a14, a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25,
                                                     a26, a27, a28, a29, a30, a31, a32, a33)])
    else:
        @flyc.kernel(known_block_size=(cfg.nt, 1, 1))
        def jrc_rope_cache(a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64,
                           a6: fx.Int64, a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64,
                           a12: fx.Int64, a13: fx.Int64, a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64,
                           a18: fx.Int64, a19: fx.Int64, a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64,
                           a24: fx.Int64, a25: fx.Int64, a26: fx.Int64, a27: fx.Int64, a28: fx.Int64, a29: fx.Int64,
                           a30: fx.Int64, a31: fx.Int64):
            emit_kernel_body(cfg, [_raw(a) for a in (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13,
                                                     a14, a15, a16, a17, a18, a19, a20, a21, a22, a23, a24, a25,
                                                     a26, a27, a28, a29, a30, a31)])

    if launch_args(cfg) > NUM_ARGS:
        @flyc.jit
        def jrc_launch(a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64,
                       a6: fx.Int64, a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64,
                       a12: fx.Int64, a13: fx.Int64, a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64,
                       a18: fx.Int64, a19: fx.Int64, a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64,
                       a24: fx.Int64, a25: fx.Int64, a26: fx.Int64, a27: fx.Int64, a28: fx.Int64, a29: fx.Int64,
                       a30: fx.Int64, a31: fx.Int64, a32: fx.Int64, a33: fx.Int64, a34: fx.Int64, a35: fx.Int64,
                       a36: fx.Int64, a37: fx.Int64):
            every = (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
                     a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37)
            jrc_rope_cache(*every[:n]).launch(grid=(1, 1, 1), block=(cfg.nt, 1, 1))

        return jrc_launch

    @flyc.jit
    def jrc_launch(a0: fx.Int64, a1: fx.Int64, a2: fx.Int64, a3: fx.Int64, a4: fx.Int64, a5: fx.Int64,
                   a6: fx.Int64, a7: fx.Int64, a8: fx.Int64, a9: fx.Int64, a10: fx.Int64, a11: fx.Int64,
                   a12: fx.Int64, a13: fx.Int64, a14: fx.Int64, a15: fx.Int64, a16: fx.Int64, a17: fx.Int64,
                   a18: fx.Int64, a19: fx.Int64, a20: fx.Int64, a21: fx.Int64, a22: fx.Int64, a23: fx.Int64,
                   a24: fx.Int64, a25: fx.Int64, a26: fx.Int64, a27: fx.Int64, a28: fx.Int64, a29: fx.Int64,
                   a30: fx.Int64, a31: fx.Int64, a32: fx.Int64, a33: fx.Int64):
        every = (a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20, a21,
                 a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33)
        jrc_rope_cache(*every[:n]).launch(grid=(1, 1, 1), block=(cfg.nt, 1, 1))

    return jrc_launch
