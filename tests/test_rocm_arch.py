"""Which ROCm code objects a lowering embeds, with the device arch mocked (runs on any CPU machine).

The lowering reads the gfx arch of this process's ROCm devices from the PJRT device attribute
`compute_capability` (XLA sets it to the gfx version on ROCm, e.g. "gfx942", possibly with
":sramecc+:xnack-"). Here `backends.rocm._rocm_devices` is replaced by fake devices and the
compiler by fake code objects, so no GPU and no FlyDSL are needed:
  * gfx942 or gfx950 devices: exactly their code objects are embedded;
  * another arch (gfx90a MI250X, gfx1100 / gfx1201 RDNA): impl=None warns and lowers the XLA path,
    impl="kernel" raises an error naming the arch, both at lowering time;
  * jax.export (and a lowering with no ROCm device) embeds gfx942 AND gfx950 whatever the devices.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_rope_cache as jrc
from jax_rope_cache.backends import launcher, rocm
from jax_rope_cache.compilers import flydsl


@dataclasses.dataclass
class FakeDevice:
    compute_capability: str | None
    device_kind: str = "AMD Instinct (mock)"
    id: int = 0
    platform: str = "rocm"


def _fake_code(arch: str) -> bytes:
    return b"\x7fELF\x02\x01" + arch.encode().ljust(58, b"\0") + b"\0jrc_rope_cache_0\0"


@pytest.fixture
def fake_compiler(monkeypatch):
    compiled = []

    def compile_config(cfg, arch, hints=None):
        compiled.append(arch)
        return flydsl.CodeObject(arch=arch, code=_fake_code(arch), symbol="jrc_rope_cache_0", info={},
                                 key=flydsl.key_for(cfg, arch))

    monkeypatch.setattr(flydsl, "compile_config", compile_config)
    monkeypatch.setattr(flydsl, "available", lambda: True)
    monkeypatch.delenv("JAX_ROPE_CACHE_ROCM_ARCHS", raising=False)
    return compiled


def _devices(monkeypatch, *archs):
    monkeypatch.setattr(rocm, "_rocm_devices", lambda: [FakeDevice(a, id=i) for i, a in enumerate(archs)])


def _args(T=5, QH=4, KH=1, D=64, NB=8, BS=16):
    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    return (s((T, QH, D), bf), s((T, KH, D), bf), s((T, KH, D), bf), s((NB, BS, KH, D), bf), s((NB, BS, KH, D), bf),
            s((T,), jnp.int32), s((T,), jnp.int32), s((64, D // 2), jnp.float32), s((64, D // 2), jnp.float32))


def _step(impl):
    return jax.jit(lambda *a: jrc.rope_and_cache(*a, impl=impl), donate_argnums=(3, 4))


def _lower_rocm(impl):
    return _step(impl).trace(*_args()).lower(lowering_platforms=("rocm",)).as_text()


def _embedded_archs(text: str) -> list[str] | None:
    """Archs of the code-object table in the lowered module's launcher call (None: no such call)."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib.mlir import ir

    found = []
    with jmlir.make_ir_context():
        module = ir.Module.parse(text)

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        if inner.operation.name == "stablehlo.custom_call":
                            target = ir.StringAttr(inner.attributes["call_target_name"]).value
                            if target.startswith("jax_rope_cache_gpu"):
                                cfg = ir.DictAttr(inner.attributes["mhlo.backend_config"])
                                found.append(ir.StringAttr(cfg["code"]).value_bytes)
                        walk(inner.operation)

        walk(module.operation)
    if not found:
        return None
    assert len(found) == 1
    return [a for _, a, _ in launcher.unpack_code_table(found[0])]


@pytest.mark.parametrize("cc,want", [("gfx942:sramecc+:xnack-", ["gfx942"]), ("gfx950", ["gfx950"]),
                                     ("gfx950:sramecc+:xnack-", ["gfx950"])])
def test_a_supported_device_gets_its_own_code_object(monkeypatch, fake_compiler, cc, want):
    _devices(monkeypatch, cc)
    assert _embedded_archs(_lower_rocm("kernel")) == want
    assert fake_compiler == want  # the other arch is not even compiled


def test_mixed_supported_devices_get_both(monkeypatch, fake_compiler):
    _devices(monkeypatch, "gfx950", "gfx942:sramecc+:xnack-", "gfx950")
    assert _embedded_archs(_lower_rocm(None)) == ["gfx942", "gfx950"]


@pytest.mark.parametrize("cc,kind", [("gfx90a:sramecc+:xnack-", "AMD Instinct MI250X"), ("gfx1100", "Radeon RX 7900 XTX"),
                                     ("gfx1201", "Radeon RX 9070 XT")])
def test_another_arch_falls_back_for_default_impl_and_raises_for_kernel(monkeypatch, fake_compiler, cc, kind):
    arch = cc.split(":")[0]
    monkeypatch.setattr(rocm, "_rocm_devices", lambda: [FakeDevice(cc, device_kind=kind)])
    with pytest.warns(RuntimeWarning, match=rf"falling back to the XLA implementation on ROCm.*is {arch}"):
        text = _lower_rocm(None)
    assert _embedded_archs(text) is None and "stablehlo.custom_call" not in text.split("func.func public @main")[0]
    with pytest.raises(rocm.UnsupportedArch, match=rf"built for gfx942 \(MI300\), gfx950.*\({kind}\) is {arch}\."):
        _lower_rocm("kernel")
    assert fake_compiler == []  # nothing compiled for a device that cannot run it


def test_one_unsupported_device_among_supported_ones_falls_back(monkeypatch, fake_compiler):
    _devices(monkeypatch, "gfx942", "gfx90a")
    with pytest.warns(RuntimeWarning, match="gfx90a"):
        assert _embedded_archs(_lower_rocm(None)) is None


def test_export_keeps_both_archs_whatever_the_devices(monkeypatch, fake_compiler):
    _devices(monkeypatch, "gfx942")
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in (launcher.GPU_TARGET, launcher.GPU_TARGET_NO_GRAPH)]
    exp = jax.export.export(_step("kernel"), platforms=["rocm"], disabled_checks=checks)(*_args())
    assert _embedded_archs(exp.mlir_module()) == ["gfx942", "gfx950"]
    _devices(monkeypatch, "gfx1100")  # an export is for other machines: the local device does not matter
    exp = jax.export.export(_step("kernel"), platforms=["rocm"], disabled_checks=checks)(*_args())
    assert _embedded_archs(exp.mlir_module()) == ["gfx942", "gfx950"]


def test_no_rocm_device_or_no_arch_attribute_embeds_every_target(monkeypatch, fake_compiler):
    _devices(monkeypatch)  # a build machine lowering for rocm
    assert _embedded_archs(_lower_rocm("kernel")) == ["gfx942", "gfx950"]
    monkeypatch.setattr(rocm, "_rocm_devices", lambda: [FakeDevice(None)])  # a plugin that does not say
    assert _embedded_archs(_lower_rocm("kernel")) == ["gfx942", "gfx950"]
    monkeypatch.setenv("JAX_ROPE_CACHE_ROCM_ARCHS", "gfx950")
    _devices(monkeypatch)
    assert _embedded_archs(_lower_rocm("kernel")) == ["gfx950"]


def test_device_arch_reads_the_gfx_name():
    assert rocm.device_arch(FakeDevice("gfx942:sramecc+:xnack-")) == "gfx942"
    assert rocm.device_arch(FakeDevice("gfx950")) == "gfx950"
    assert rocm.device_arch(FakeDevice("9.0")) is None  # a CUDA-style value is not a gfx name
    assert rocm.device_arch(FakeDevice(None)) is None
    assert rocm.device_arch(object()) is None


def test_real_cpu_devices_are_not_taken_for_rocm_ones():
    # On this machine jax has no ROCm backend: the lowering sees no ROCm device.
    try:
        has_rocm = bool(jax.devices("rocm"))
    except RuntimeError:
        has_rocm = False
    if has_rocm:
        pytest.skip("this host has ROCm devices")
    assert rocm._rocm_devices() == []
    assert rocm.lowering_archs() == rocm.target_archs()


def test_no_warning_on_a_supported_device(monkeypatch, fake_compiler):
    _devices(monkeypatch, "gfx942")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _lower_rocm(None)
    assert np.all(np.array(fake_compiler) == "gfx942")


def test_the_suite_refuses_a_rocm_host_whose_kernel_cannot_be_built(monkeypatch):
    """tests/conftest.py stops the run (unless JRC_ALLOW_NO_GPU_KERNEL=1) when jax has a ROCm
    backend but the kernel cannot be built or the GPU has no kernel: otherwise the ("rocm",
    "kernel") cases would silently not be generated and the suite would pass on the XLA path."""
    import conftest

    real = jax.devices
    arch = ["gfx942"]
    monkeypatch.setattr(jax, "devices", lambda name=None: [FakeDevice(arch[0])] if name == "rocm" else real(name))
    monkeypatch.setattr(rocm, "_rocm_devices", lambda: [FakeDevice(arch[0])])
    monkeypatch.setattr(rocm, "missing", lambda: None)
    assert conftest._gpu_kernels_missing() == []
    monkeypatch.setattr(rocm, "missing", lambda: "FlyDSL to compile the kernel (not installed)")
    assert conftest._gpu_kernels_missing() == ["rocm: needs FlyDSL to compile the kernel (not installed)"]
    monkeypatch.setattr(rocm, "missing", lambda: None)
    arch[0] = "gfx1100"
    (msg,) = conftest._gpu_kernels_missing()
    assert msg.startswith("rocm: needs a gfx942 or gfx950 GPU") and "is gfx1100" in msg


def _launcher_operand_producers(text: str) -> list[str]:
    """For each operand of the lowered module's launcher call: the op that produces it (or "arg")."""
    from jax._src.interpreters import mlir as jmlir
    from jax._src.lib.mlir import ir

    with jmlir.make_ir_context():
        module = ir.Module.parse(text)
        found = []

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        if (inner.operation.name == "stablehlo.custom_call" and
                                ir.StringAttr(inner.attributes["call_target_name"]).value.startswith("jax_rope_cache_gpu")):
                            found.append(["arg" if isinstance(o.owner, ir.Block) else o.owner.name
                                          for o in inner.operands])
                        walk(inner.operation)

        walk(module.operation)
    assert len(found) == 1, found
    return found[0]


def test_gpu_lowering_fences_the_small_operands(monkeypatch, fake_compiler):
    """The launcher's custom call takes slot_mapping, positions, the scales, the layer and the norm
    weights from an optimization barrier (launcher.fence_small_operands): a dynamic slice of them
    (slots[n] in a decode loop) cannot become a dynamic-slice fusion around the call, which XLA
    re-records every step. q, k, v, the caches and the tables are passed as they are."""
    from jax_rope_cache import contract

    _devices(monkeypatch, "gfx942")
    producers = _launcher_operand_producers(_lower_rocm("kernel"))
    assert len(producers) == len(contract.OPERANDS)
    for name, producer in zip(contract.OPERANDS, producers):
        fenced = name in contract.FENCED_OPERANDS
        assert (producer == "stablehlo.optimization_barrier") == fenced, (name, producer)
