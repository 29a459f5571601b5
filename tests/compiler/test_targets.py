"""Target profiles: built-ins, user files (YAML / JSON), strict validation, npu_mode vs cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pulsar.compiler.targets import TargetProfile, builtin_profiles, cores_for, load_profile
from pulsar.errors import PulsarError

GOOD = {
    "name": "my-npu",
    "description": "test device",
    "cores": 2,
    "int8_macs_per_cycle_per_core": 512,
    "int16_macs_per_cycle_per_core": 128,
    "clock_mhz": 500,
    "onchip_memory_kib": 1024,
    "ddr_bandwidth_gbps": 8.5,
    "vector_ops_per_cycle_per_core": 32,
    "op_overhead_cycles": 10,
}


def write(tmp_path: Path, data: object, suffix: str = ".yaml") -> Path:
    path = tmp_path / f"profile{suffix}"
    path.write_text(json.dumps(data) if suffix == ".json" else yaml.safe_dump(data))
    return path


def test_builtin_profiles_load_and_are_plausible() -> None:
    files = builtin_profiles()
    assert set(files) == {"VNPU-S", "VNPU-M", "VNPU-L"}
    loaded = {name: load_profile(name) for name in files}
    s, m, l_ = loaded["VNPU-S"], loaded["VNPU-M"], loaded["VNPU-L"]
    assert (s.cores, m.cores, l_.cores) == (1, 2, 4)
    assert 0.3 < s.peak_tops() < 1.0 and 2.0 < m.peak_tops() < 5.0 and l_.peak_tops() >= 10.0
    for name, p in loaded.items():
        assert p.name == name
        assert p.int16_macs_per_cycle_per_core * 4 == p.int8_macs_per_cycle_per_core
        assert 4 <= p.ddr_bandwidth_gbps <= 25.6
        assert 512 <= p.onchip_memory_kib <= 4096
        assert "not vendor data" in files[name].read_text()
        assert Path(p.source) == files[name]
    assert s.peak_tops() < m.peak_tops() < l_.peak_tops()


def test_builtin_files_are_inside_the_package() -> None:
    import pulsar

    root = Path(pulsar.__file__).resolve().parent
    for path in builtin_profiles().values():
        assert path.resolve().is_relative_to(root / "compiler" / "targets")


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_user_profile_file_loads(tmp_path: Path, suffix: str) -> None:
    path = write(tmp_path, GOOD, suffix)
    p = load_profile(str(path))
    assert isinstance(p, TargetProfile)
    assert (p.name, p.cores, p.clock_mhz, p.ddr_bandwidth_gbps) == ("my-npu", 2, 500, 8.5)
    assert p.peak_tops() == pytest.approx(2 * 512 * 2 * 500e6 / 1e12)
    assert p.peak_tops(16) == pytest.approx(p.peak_tops() / 4)
    assert p.ddr_bytes_per_cycle() == pytest.approx(8.5e9 / 500e6)
    assert p.ddr_bytes_per_cycle(ddr_bw_limit_gbps=1.0) == pytest.approx(1e9 / 500e6)
    assert p.ddr_bytes_per_cycle(ddr_bw_limit_gbps=100.0) == pytest.approx(8.5e9 / 500e6)


def test_relative_path_resolves_against_base_dir(tmp_path: Path) -> None:
    write(tmp_path, GOOD)
    assert load_profile("profile.yaml", base_dir=tmp_path).name == "my-npu"


def test_optional_fields_default(tmp_path: Path) -> None:
    data = {k: v for k, v in GOOD.items() if k not in ("name", "description", "op_overhead_cycles")}
    p = load_profile(write(tmp_path, data))
    assert (p.name, p.description, p.op_overhead_cycles) == ("profile", "", 0)


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        ({"clock_mhz": None}, "clock_mhz", "missing"),
        ({"cores": 0}, "cores", "positive"),
        ({"ddr_bandwidth_gbps": -3.0}, "ddr_bandwidth_gbps", "positive"),
        ({"op_overhead_cycles": -1}, "op_overhead_cycles", "zero or positive"),
        ({"cores": 1.5}, "cores", "integer"),
        ({"clock_mhz": "fast"}, "clock_mhz", "number"),
        ({"cores": True}, "cores", "integer"),
        ({"name": 3}, "name", "string"),
        ({"int8_macs_per_cycle": 256}, "int8_macs_per_cycle", 'did you mean "int8_macs_per_cycle_per_core"'),
    ],
)
def test_bad_profile_names_file_and_field(tmp_path: Path, change: dict, field: str, words: str) -> None:
    data = dict(GOOD)
    for key, value in change.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    for suffix in (".yaml", ".json"):
        path = write(tmp_path, data, suffix)
        with pytest.raises(PulsarError) as err:
            load_profile(str(path))
        msg = str(err.value)
        assert str(path) in msg and repr(field) in msg and words in msg


def test_unreadable_or_wrong_shape_files(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("cores: [1, 2\n")
    with pytest.raises(PulsarError, match=r"bad\.yaml.*not valid YAML"):
        load_profile(bad_yaml)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{\"cores\": 1,, }")  # two commas: not JSON, nor JSON5
    with pytest.raises(PulsarError, match=r"bad\.json.*not valid JSON"):
        load_profile(bad_json)
    with pytest.raises(PulsarError, match="expected a mapping"):
        load_profile(write(tmp_path, [1, 2, 3]))
    with pytest.raises(PulsarError, match="does not exist"):
        load_profile(str(tmp_path / "nope.yaml"))


def test_unknown_builtin_name_suggests() -> None:
    with pytest.raises(PulsarError, match='did you mean "VNPU-M"'):
        load_profile("VNPU-MM")


def test_cores_for_npu_mode() -> None:
    m = load_profile("VNPU-M")
    assert [cores_for(m, mode) for mode in ("NPU1", "NPU2")] == [1, 2]
    assert cores_for(load_profile("VNPU-L"), "NPU4") == 4
    with pytest.raises(PulsarError) as err:
        cores_for(m, "NPU3")
    assert "npu_mode NPU3" in str(err.value) and "VNPU-M" in str(err.value) and "NPU1 / NPU2" in str(err.value)
    with pytest.raises(PulsarError, match="npu_mode NPU2.*VNPU-S"):
        cores_for(load_profile("VNPU-S"), "NPU2")
    with pytest.raises(PulsarError, match="npu_mode 'NPU9'"):
        cores_for(m, "NPU9")
