"""The on-disk ahead-of-time cache of compiled programs (`capopt._jaxcache`)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from capopt import _jaxcache
from capopt.cost import numbers_pytree
from capopt.search.relax import Compiled, initial_points, make_solver, scenario_bounds

from conftest import llama_like, make_scenario


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPOPT_CACHE_DIR", str(tmp_path))
    return tmp_path


def _program(name="test-program"):
    return Compiled(lambda x, d: {"y": x * d["a"] + d["b"]}, name=name)


def _args():
    return jnp.arange(4.0), {"a": jnp.float32(2.0), "b": jnp.float32(1.0)}


def _no_tracing(program):
    def refuse(*_):
        raise AssertionError("traced although the executable was on disk")
    program.jitted = type("NoTrace", (), {"trace": staticmethod(refuse)})()
    return program


def test_a_named_program_is_loaded_from_disk_without_tracing(cache_dir):
    first = _program()
    want = first(*_args())["y"]
    _jaxcache.flush_writes()
    assert len(list((cache_dir / "aot").glob("test-program-*.pkl"))) == 1
    second = _no_tracing(_program())
    got = second(*_args())["y"]
    assert second.loaded_from_disk == 1
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))   # same executable


def test_the_solver_loaded_from_disk_gives_the_same_solution(cache_dir):
    sc = make_scenario(llama_like(), count=8)
    args = (initial_points(4, 0), numbers_pytree(sc), scenario_bounds(sc))
    want = make_solver(steps=20)(*args)
    _jaxcache.flush_writes()
    loaded = _no_tracing(make_solver(steps=20))
    got = loaded(*args)
    assert loaded.loaded_from_disk == 1
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_other_shapes_names_or_code_miss(cache_dir, monkeypatch):
    _program()(*_args())
    _jaxcache.flush_writes()
    same = _program()
    same(*_args())
    longer = _program()
    longer(jnp.arange(5.0), _args()[1])                 # another argument shape
    other = _program(name="another-program")
    other(*_args())
    monkeypatch.setattr(_jaxcache, "_fixed_part", lambda: "different source or versions")
    changed = _program()
    changed(*_args())
    with jax.default_matmul_precision("highest"):       # another JAX configuration
        configured = _program()
        configured(*_args())
    assert same.loaded_from_disk == 1
    assert (longer.loaded_from_disk, other.loaded_from_disk, changed.loaded_from_disk,
            configured.loaded_from_disk) == (0, 0, 0, 0)


def test_an_unreadable_entry_is_compiled_again(cache_dir):
    _program()(*_args())
    _jaxcache.flush_writes()
    (entry,) = (cache_dir / "aot").glob("test-program-*.pkl")
    entry.write_bytes(b"not an executable")
    again = _program()
    np.testing.assert_array_equal(np.asarray(again(*_args())["y"]), [1.0, 3.0, 5.0, 7.0])
    assert again.loaded_from_disk == 0
    _jaxcache.flush_writes()
    assert _program()(*_args()) is not None and _jaxcache.load_program(
        _jaxcache.program_path("test-program", repr(Compiled.signature(_args())))
    ) is not None   # rewritten


def test_an_empty_cache_dir_setting_turns_the_cache_off(monkeypatch, tmp_path):
    monkeypatch.setenv("CAPOPT_CACHE_DIR", "")
    monkeypatch.chdir(tmp_path)
    _program()(*_args())
    _jaxcache.flush_writes()
    assert _jaxcache.program_path("test-program", "x") is None
    assert not list(tmp_path.rglob("*.pkl"))


def test_old_entries_of_a_program_are_pruned(cache_dir, monkeypatch):
    monkeypatch.setattr(_jaxcache, "KEEP_PER_NAME", 2)
    for i in range(4):                       # four versions of the code, one entry each
        monkeypatch.setattr(_jaxcache, "_fixed_part", lambda i=i: f"version {i}")
        _program()(*_args())
        _jaxcache.flush_writes()
        for entry in (cache_dir / "aot").glob("test-program-*.pkl"):   # older: used earlier
            st = entry.stat()
            os.utime(entry, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))
    assert len(list((cache_dir / "aot").glob("test-program-*.pkl"))) == 2
    newest = _program()
    newest(*_args())
    assert newest.loaded_from_disk == 1          # the newest is still there


def test_an_executable_from_jaxs_own_cache_is_used_but_not_stored(cache_dir):
    # XLA:CPU cannot serialise an executable that was itself deserialised: stored again, it
    # would lack its kernels. A compilation during which JAX reports a cache hit is not stored.
    real = jax.jit(lambda x: x + 1.0).trace(jnp.arange(3.0)).lower()

    class FromJaxsCache:
        def compile(self):
            jax.monitoring.record_event(_jaxcache.CACHE_HIT_EVENT)
            return real.compile()

    exe, fresh = _jaxcache.compile_for_cache(FromJaxsCache())
    assert not fresh
    np.testing.assert_array_equal(np.asarray(exe(jnp.arange(3.0))), [1.0, 2.0, 3.0])
    exe, fresh = _jaxcache.compile_for_cache(real)
    assert fresh


def test_an_entry_that_fails_to_run_is_discarded_and_compiled(cache_dir, monkeypatch):
    _program()(*_args())
    _jaxcache.flush_writes()

    def broken(*_):
        raise jax.errors.JaxRuntimeError("NOT_FOUND: Function fusion not found")
    monkeypatch.setattr(_jaxcache, "load_program", lambda *_: broken)
    again = _program()
    np.testing.assert_array_equal(np.asarray(again(*_args())["y"]), [1.0, 3.0, 5.0, 7.0])
    assert again.loaded_from_disk == 0
    assert not list((cache_dir / "aot").glob("test-program-*.pkl"))     # discarded
    _jaxcache.flush_writes()
    assert len(list((cache_dir / "aot").glob("test-program-*.pkl"))) == 1   # compiled afresh


# ---- faults of the on-disk cache: each falls back to compiling, with at most one warning line


@pytest.fixture
def one_warning(monkeypatch, caplog):
    """The warnings capopt's cache logged in the test (the once-per-process flag reset)."""
    monkeypatch.setattr(_jaxcache, "_warned", threading.Event())
    caplog.set_level("WARNING", logger="capopt")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "capopt"]


def _entries(cache_dir, name="test-program"):
    return sorted((cache_dir / "aot").glob(f"{name}-*.pkl"))


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                    reason="mode 000 does not stop root; the next test stands in for it")
def test_a_cache_folder_with_mode_000_compiles_with_one_warning(cache_dir, one_warning):
    cache_dir.chmod(0)
    try:
        got = _program()(*_args())["y"]
        _jaxcache.flush_writes()
    finally:
        cache_dir.chmod(0o700)
    np.testing.assert_array_equal(np.asarray(got), [1.0, 3.0, 5.0, 7.0])
    assert len(one_warning()) == 1 and "\n" not in one_warning()[0]


def test_a_cache_folder_without_permission_compiles_with_one_warning(cache_dir, monkeypatch,
                                                                      one_warning):
    # what a user who is not root gets from a folder with mode 000 (os.access says no), and
    # from entries that cannot be looked at or read (the OS raises PermissionError)
    _program()(*_args())
    _jaxcache.flush_writes()
    assert len(_entries(cache_dir)) == 1
    real_access, real_stat = os.access, Path.stat

    def no_access(path, mode, *a, **k):
        return False if Path(path) == cache_dir else real_access(path, mode, *a, **k)
    monkeypatch.setattr(os, "access", no_access)
    assert _jaxcache.program_path("test-program", "x") is None
    monkeypatch.setattr(os, "access", real_access)

    def denied(self, *a, **k):
        if str(self).startswith(str(cache_dir / "aot")):
            raise PermissionError(13, "Permission denied", str(self))
        return real_stat(self, *a, **k)
    monkeypatch.setattr(Path, "stat", denied)
    again = _program()
    np.testing.assert_array_equal(np.asarray(again(*_args())["y"]), [1.0, 3.0, 5.0, 7.0])
    assert again.loaded_from_disk == 0
    _jaxcache.flush_writes()                                # does not raise either
    assert len(one_warning()) == 1 and "\n" not in one_warning()[0]
    assert "Permission denied" in one_warning()[0] or "permission" in one_warning()[0]


def test_two_swapped_entries_are_discarded_and_compiled(cache_dir, one_warning):
    # each file holds the other program's executable: it loads, but it is not this entry
    longer = (jnp.arange(5.0), _args()[1])
    _program()(*_args())
    _program()(*longer)
    _jaxcache.flush_writes()
    a, b = _entries(cache_dir)
    blob_a, blob_b = a.read_bytes(), b.read_bytes()
    a.write_bytes(blob_b)
    b.write_bytes(blob_a)
    for args, want in ((_args(), [1.0, 3.0, 5.0, 7.0]), (longer, [1.0, 3.0, 5.0, 7.0, 9.0])):
        again = _program()
        np.testing.assert_array_equal(np.asarray(again(*args)["y"]), want)
        assert again.loaded_from_disk == 0
    assert _entries(cache_dir) == [] and len(one_warning()) == 1
    _jaxcache.flush_writes()                                # written afresh, and then loaded
    assert len(_entries(cache_dir)) == 2
    loaded = _no_tracing(_program())
    loaded(*_args())
    assert loaded.loaded_from_disk == 1


AOT_IS_A_FILE = """
import jax.numpy as jnp
from capopt._compiled import Compiled
print(float(Compiled(lambda x: jnp.sin(x) * 2.0, name="child-program")(jnp.arange(4.0)).sum()))
"""


def test_an_aot_path_that_is_a_file_compiles_and_exits_cleanly(tmp_path):
    """The real path, in a process of its own: the entries are written at exit, where a
    failure used to end the process with a traceback."""
    (tmp_path / "aot").write_text("not a folder")
    env = dict(os.environ, CAPOPT_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", AOT_IS_A_FILE], env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr
    assert float(run.stdout) == pytest.approx(float(jnp.sum(jnp.sin(jnp.arange(4.0)) * 2.0)))
    capopt_lines = [ln for ln in run.stderr.splitlines() if "capopt" in ln]
    assert "Traceback" not in run.stderr and len(capopt_lines) == 1, run.stderr
    assert (tmp_path / "aot").read_text() == "not a folder"


CHILD = """
import jax
import jax.numpy as jnp
from capopt import _jaxcache
from capopt._compiled import Compiled
_jaxcache.enable()
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)   # JAX caches all
def plain_control(x):
    return jnp.cos(x) + 1.0
jax.jit(plain_control)(jnp.arange(4.0)).block_until_ready()       # JAX's cache writes this
program = Compiled(lambda x: jnp.sin(x) * 2.0, name="child-program")
print(float(program(jnp.arange(4.0)).sum()), program.loaded_from_disk)
"""


def test_a_program_written_at_exit_is_loaded_by_the_next_process(tmp_path):
    """The real path: the first process compiles and writes at exit (not before); the next
    loads the executable; JAX's own cache holds no copy of the program."""
    env = dict(os.environ, CAPOPT_CACHE_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
    runs = [subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                           text=True, check=True).stdout.split() for _ in range(2)]
    assert runs[0][0] == runs[1][0]                       # the same result
    assert (runs[0][1], runs[1][1]) == ("0", "1")         # compiled, then loaded
    assert len(list((tmp_path / "aot").glob("child-program-*.pkl"))) == 1
    jax_entries = [p.name for p in tmp_path.iterdir() if p.is_file()]
    assert any("plain_control" in name for name in jax_entries)          # the control
    assert not any("child_program" in name for name in jax_entries)
