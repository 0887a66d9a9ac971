"""Pure-Python reading of AMDGPU code objects: the NT_AMDGPU_METADATA note (msgpack).

No dependency: a small ELF64 section walker and a msgpack decoder covering what the AMDGPU
metadata uses (maps, arrays, strings, integers, booleans, nil, floats, binary).
"""

import struct

NT_AMDGPU_METADATA = 32
EM_AMDGPU = 0xE0
ELFOSABI_AMDGPU_HSA = 64
# The oldest ROCm whose loader takes a code-object version (FlyDSL 0.5.0 emits v6). The launcher's
# load error (kernels/ffi/gpu_launcher.cc) names the same facts.
MIN_ROCM = {6: (6, 3)}


def code_object_version(code: bytes) -> int | None:
    """The AMDHSA code-object version of an AMDGPU ELF (EI_ABIVERSION 2, 3, 4 = v4, v5, v6), or
    None when the image is not an AMDHSA code object."""
    if len(code) < 16 or code[:4] != b"\x7fELF" or code[7] != ELFOSABI_AMDGPU_HSA:
        return None
    return code[8] + 2


class CodeObjectError(ValueError):
    pass


def _unpack(data: bytes, pos: int):
    b = data[pos]
    pos += 1
    if b <= 0x7F:
        return b, pos
    if b >= 0xE0:
        return b - 0x100, pos
    if 0x80 <= b <= 0x8F:
        return _map(data, pos, b & 0x0F)
    if 0x90 <= b <= 0x9F:
        return _array(data, pos, b & 0x0F)
    if 0xA0 <= b <= 0xBF:
        n = b & 0x1F
        return data[pos:pos + n].decode(), pos + n
    if b == 0xC0:
        return None, pos
    if b == 0xC2:
        return False, pos
    if b == 0xC3:
        return True, pos
    fixed = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
             0xCA: ">f", 0xCB: ">d"}
    if b in fixed:
        fmt = fixed[b]
        n = struct.calcsize(fmt)
        return struct.unpack_from(fmt, data, pos)[0], pos + n
    if b in (0xD9, 0xDA, 0xDB, 0xC4, 0xC5, 0xC6):
        lf = {0xD9: ">B", 0xDA: ">H", 0xDB: ">I", 0xC4: ">B", 0xC5: ">H", 0xC6: ">I"}[b]
        n = struct.unpack_from(lf, data, pos)[0]
        pos += struct.calcsize(lf)
        raw = data[pos:pos + n]
        return (raw.decode() if b >= 0xD9 else bytes(raw)), pos + n
    if b in (0xDC, 0xDD):
        lf = ">H" if b == 0xDC else ">I"
        n = struct.unpack_from(lf, data, pos)[0]
        return _array(data, pos + struct.calcsize(lf), n)
    if b in (0xDE, 0xDF):
        lf = ">H" if b == 0xDE else ">I"
        n = struct.unpack_from(lf, data, pos)[0]
        return _map(data, pos + struct.calcsize(lf), n)
    raise CodeObjectError(f"msgpack: unsupported type byte 0x{b:02x}")


def _array(data, pos, n):
    out = []
    for _ in range(n):
        v, pos = _unpack(data, pos)
        out.append(v)
    return out, pos


def _map(data, pos, n):
    out = {}
    for _ in range(n):
        k, pos = _unpack(data, pos)
        v, pos = _unpack(data, pos)
        out[k] = v
    return out, pos


def msgpack_loads(data: bytes):
    v, pos = _unpack(data, 0)
    return v


def _sections(elf: bytes):
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise CodeObjectError("not a little-endian ELF64 file")
    e_machine = struct.unpack_from("<H", elf, 18)[0]
    if e_machine != EM_AMDGPU:
        raise CodeObjectError(f"not an AMDGPU ELF (e_machine 0x{e_machine:x})")
    e_shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    secs = []
    for i in range(e_shnum):
        off = e_shoff + i * e_shentsize
        name, typ, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", elf, off)
        secs.append((name, typ, offset, size))
    strtab = secs[e_shstrndx]
    names = elf[strtab[2]:strtab[2] + strtab[3]]
    out = []
    for name, typ, offset, size in secs:
        end = names.index(b"\0", name)
        out.append((names[name:end].decode(), typ, elf[offset:offset + size]))
    return out


def metadata(elf: bytes) -> dict:
    """The decoded NT_AMDGPU_METADATA map of a code object."""
    for _name, typ, data in _sections(elf):
        if typ != 7:  # SHT_NOTE
            continue
        pos = 0
        while pos + 12 <= len(data):
            namesz, descsz, ntype = struct.unpack_from("<III", data, pos)
            pos += 12
            name = data[pos:pos + namesz].rstrip(b"\0")
            pos += (namesz + 3) & ~3
            desc = data[pos:pos + descsz]
            pos += (descsz + 3) & ~3
            if name == b"AMDGPU" and ntype == NT_AMDGPU_METADATA:
                return msgpack_loads(desc)
    raise CodeObjectError("no NT_AMDGPU_METADATA note in the code object")


def kernel_info(elf: bytes) -> dict:
    """Metadata of the single kernel of a code object (symbol, arguments, sizes, registers)."""
    md = metadata(elf)
    kernels = md.get("amdhsa.kernels", [])
    if len(kernels) != 1:
        raise CodeObjectError(f"expected one kernel in the code object, found {len(kernels)}")
    k = kernels[0]
    return dict(
        name=k[".name"], symbol=k[".symbol"],
        target=md.get("amdhsa.target", ""),
        args=[dict(offset=a[".offset"], size=a[".size"], kind=a[".value_kind"]) for a in k.get(".args", [])],
        kernarg_size=k[".kernarg_segment_size"],
        private_segment_size=k[".private_segment_fixed_size"],
        group_segment_size=k[".group_segment_fixed_size"],
        reqd_workgroup_size=k.get(".reqd_workgroup_size"),
        max_flat_workgroup_size=k.get(".max_flat_workgroup_size"),
        wavefront_size=k.get(".wavefront_size"),
        vgpr_count=k.get(".vgpr_count"), sgpr_count=k.get(".sgpr_count"),
        agpr_count=k.get(".agpr_count", 0),
        vgpr_spill_count=k.get(".vgpr_spill_count", 0), sgpr_spill_count=k.get(".sgpr_spill_count", 0),
        version=md.get("amdhsa.version"),
    )
