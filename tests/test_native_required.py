"""A failed compile of the native kernels: a one-line warning and the PyTorch path by default, an error
under SUDU_REQUIRE_NATIVE=1 (CI's setting, .ci/run), so a green CI run has tested the default CPU path.
A source that cannot compile stands in for a broken toolchain."""
import pytest

from sudu import kernels


@pytest.fixture
def broken_build(tmp_path, monkeypatch):
    source = tmp_path / "broken.cpp"
    source.write_text("#error this source does not compile, on purpose\n")
    monkeypatch.setattr(kernels, "_SOURCES", [source])
    monkeypatch.setattr(kernels, "build_dir", lambda: tmp_path / "build")
    monkeypatch.setattr(kernels, "_state", {})  # this process's decision, made afresh
    monkeypatch.setattr(kernels, "disabled_reason", lambda: None)


def test_a_failed_compile_falls_back_with_a_warning(broken_build, monkeypatch):
    monkeypatch.delenv("SUDU_REQUIRE_NATIVE", raising=False)
    with pytest.warns(UserWarning, match="native quantized kernels unavailable"):
        assert kernels.load() is None
    assert kernels.load() is None  # decided once


def test_a_failed_compile_is_an_error_when_native_is_required(broken_build, monkeypatch):
    monkeypatch.setenv("SUDU_REQUIRE_NATIVE", "1")
    with pytest.raises(RuntimeError, match="SUDU_REQUIRE_NATIVE"):
        kernels.load()
    with pytest.raises(RuntimeError, match="failed to compile"):  # every later caller too, without a rebuild
        kernels.load()


def test_the_switch_reads_as_documented(monkeypatch):
    for value, required in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("SUDU_REQUIRE_NATIVE", value)
        assert kernels.native_required() is required
