"""hlat.plan.peak: matmul peak measurement and its per-host cache (tiny sizes, CPU only)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from hlat.plan import peak

TINY = {"n": 128, "seconds": 0.05, "repeats": 2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_measure_is_positive_finite_and_plausible(dtype: torch.dtype) -> None:
    flops = peak.measure_matmul_flops(dtype, **TINY)
    assert isinstance(flops, float)
    assert math.isfinite(flops)
    assert 1e6 < flops < 1e14


def test_measure_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="positive"):
        peak.measure_matmul_flops(torch.float32, n=0)
    with pytest.raises(ValueError, match="positive"):
        peak.measure_matmul_flops(torch.float32, n=64, seconds=0)
    with pytest.raises(ValueError, match="positive"):
        peak.measure_matmul_flops(torch.float32, n=64, repeats=0)


def test_fingerprint_is_short_stable_and_tracks_threads() -> None:
    fp = peak.host_fingerprint()
    assert re.fullmatch(r"[0-9a-f]{12}", fp)
    assert peak.host_fingerprint() == fp
    info = peak.host_info()
    assert set(info) == {"cpu", "cores", "torch", "threads"}
    assert info["torch"] == torch.__version__
    assert info["threads"] == torch.get_num_threads()
    assert isinstance(info["cores"], int) and info["cores"] >= 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert peak.host_fingerprint() != fp
    finally:
        torch.set_num_threads(threads)
    assert peak.host_fingerprint() == fp


def test_cache_path_is_under_the_dir_and_names_the_fingerprint(tmp_path: Path) -> None:
    assert peak.cache_path(tmp_path) == tmp_path / f"peak-{peak.host_fingerprint()}.json"
    assert peak.cache_path("~/x").parent == Path("~/x").expanduser()


def test_cache_round_trip(tmp_path: Path) -> None:
    flops = peak.measure_and_cache(tmp_path, ("float32", "bfloat16"), **TINY)
    assert set(flops) == {"float32", "bfloat16"}
    path = peak.cache_path(tmp_path)
    record = json.loads(path.read_text())
    assert record["fingerprint"] == peak.host_fingerprint()
    assert record["host"] == peak.host_info()
    assert record["flops"] == flops
    assert record["measured_at"].endswith("+00:00")
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    assert peak.cached_peak("float32", tmp_path) == flops["float32"]
    assert peak.cached_peak("bfloat16", tmp_path) == flops["bfloat16"]
    assert peak.cached_peak("float16", tmp_path) is None


def test_nothing_cached_is_none(tmp_path: Path) -> None:
    assert peak.cached_peak("float32", tmp_path) is None
    assert peak.cached_peak("float32", tmp_path / "missing") is None


def test_unknown_dtype_name_fails_before_measuring(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown torch dtype"):
        peak.measure_and_cache(tmp_path, ("float32", "nonsense"), **TINY)
    assert not peak.cache_path(tmp_path).exists()


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "",
        "[]",
        '{"fingerprint": "FP", "flops": []}',
        '{"fingerprint": "FP", "flops": {"float32": "fast"}}',
        '{"fingerprint": "FP", "flops": {"float32": -1.0}}',
        '{"fingerprint": "FP", "flops": {"float32": NaN}}',
        '{"fingerprint": "FP", "flops": {"float32": true}}',
        '{"fingerprint": "FP"}',
    ],
)
def test_corrupt_cache_is_none(tmp_path: Path, content: str) -> None:
    path = peak.cache_path(tmp_path)
    path.write_text(content.replace("FP", peak.host_fingerprint()))
    assert peak.cached_peak("float32", tmp_path) is None


def test_a_valid_hand_written_cache_is_read(tmp_path: Path) -> None:
    # The corrupt cases above only count if the same shape with a good value does read back.
    path = peak.cache_path(tmp_path)
    path.write_text(json.dumps({"fingerprint": peak.host_fingerprint(), "flops": {"float32": 3}}))
    assert peak.cached_peak("float32", tmp_path) == 3.0


def test_another_hosts_cache_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peak, "host_fingerprint", lambda: "aaaaaaaaaaaa")
    flops = peak.measure_and_cache(tmp_path, ("float32",), **TINY)
    assert (tmp_path / "peak-aaaaaaaaaaaa.json").exists()
    assert peak.cached_peak("float32", tmp_path) == flops["float32"]
    monkeypatch.setattr(peak, "host_fingerprint", lambda: "bbbbbbbbbbbb")
    assert peak.cached_peak("float32", tmp_path) is None


def test_a_file_recording_another_fingerprint_is_not_read(tmp_path: Path) -> None:
    # e.g. a cache file copied or renamed between hosts
    path = peak.cache_path(tmp_path)
    path.write_text(json.dumps({"fingerprint": "0123456789ab", "flops": {"float32": 1e11}}))
    assert peak.cached_peak("float32", tmp_path) is None


def test_main_prints_a_table_and_caches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--size", "128", "--seconds", "0.05", "--repeats", "2", "--dtypes", "float32", "bfloat16"]
    assert peak.main([*argv, "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| dtype | GFLOP/s |" in out
    rows = dict(re.findall(r"^\| (\w+) \| ([0-9.]+) \|$", out, flags=re.M))
    assert set(rows) == {"float32", "bfloat16"}
    assert all(float(v) > 0 for v in rows.values())
    path = peak.cache_path(tmp_path)
    assert str(path) in out
    for name, gflops in rows.items():
        cached = peak.cached_peak(name, tmp_path)
        assert cached is not None
        assert cached / 1e9 == pytest.approx(float(gflops), abs=0.06)
