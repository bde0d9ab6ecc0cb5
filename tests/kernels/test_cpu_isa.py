"""The ISA probe and its cap: levels from the CPU's flags on x86 and ARM, a cap that only
lowers, one-line errors that name what the CPU runs, and the flags each level builds with."""

from __future__ import annotations

import pytest

from yaied.kernels import cpu_isa
from yaied.kernels.cpu_isa import IsaError, detected_level, selected_level

ZEN3 = frozenset(["sse4_2", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"])
ICELAKE = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
SAPPHIRE_RAPIDS = ICELAKE | {"avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize(
    "features, level",
    [
        (frozenset({"sse2", "avx"}), "generic"),
        (ZEN3, "avx2"),
        (ZEN3 - {"fma"}, "generic"),
        (ICELAKE, "avx512"),
        (ICELAKE - {"avx512dq"}, "avx2"),
        (SAPPHIRE_RAPIDS, "avx512_bf16"),
        (ZEN3 | {"avx512_bf16"}, "avx2"),  # bf16 dots need AVX-512 under them
    ],
)
def test_level_from_flags(monkeypatch, features, level):
    monkeypatch.setattr(cpu_isa, "_is_x86", lambda: True)
    assert detected_level(features) == level


def test_arm_is_generic(monkeypatch):
    monkeypatch.setattr(cpu_isa, "_is_x86", lambda: False)
    assert detected_level(frozenset({"fp", "asimd", "bf16"})) == "generic"
    assert cpu_isa.compiler_flags("generic") == ()


def test_the_cap_only_lowers(monkeypatch):
    monkeypatch.setattr(cpu_isa, "detected_level", lambda features=None: "avx2")
    assert selected_level({}) == "avx2"
    assert selected_level({"YAIED_CPU_ISA": "generic"}) == "generic"
    assert selected_level({"YAIED_CPU_ISA": " AVX2 "}) == "avx2"
    with pytest.raises(IsaError, match="above what this CPU supports; it runs: generic, avx2"):
        selected_level({"YAIED_CPU_ISA": "avx512_bf16"})
    with pytest.raises(IsaError, match="'sse9' is not a level .* this CPU runs: generic, avx2"):
        selected_level({"YAIED_CPU_ISA": "sse9"})


def test_this_cpus_level_is_runnable():
    level = detected_level()
    assert cpu_isa.runnable_levels()[-1] == level
    assert selected_level({}) == level


def test_flags_build_the_cpus_own_level_natively_and_lower_ones_portably(monkeypatch):
    monkeypatch.setattr(cpu_isa, "_is_x86", lambda: True)
    monkeypatch.setattr(cpu_isa, "detected_level", lambda features=None: "avx512_bf16")
    assert cpu_isa.compiler_flags("avx512_bf16") == ("-march=native",)
    assert cpu_isa.compiler_flags("avx2")[0] == "-march=x86-64-v3"
    assert cpu_isa.compiler_flags("avx512")[0] == "-march=x86-64-v4"
    assert cpu_isa.compiler_flags("generic") == ()


def test_bf16_math_only_with_bf16_dots_and_torch_caps():
    assert cpu_isa.has_bf16_math("avx512_bf16")
    assert not any(cpu_isa.has_bf16_math(level) for level in ("generic", "avx2", "avx512"))
    if cpu_isa._is_x86():
        assert cpu_isa.torch_caps("avx2") == {
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        }
        assert cpu_isa.torch_caps("avx512_bf16") == {}
