"""`capopt setup xla-gpu`: where the CUDA plugin is looked for and how its install fails."""

import subprocess

import pytest

from capopt.cli import main
from capopt.validation import plugin


def _fake_plugin(folder):
    (folder / "jax_plugins").mkdir(parents=True)
    return folder


def test_an_installed_folder_is_left_alone(tmp_path, monkeypatch):
    def no_pip(*a, **k):
        raise AssertionError("pip must not run when the plugin is already there")
    monkeypatch.setattr(subprocess, "run", no_pip)
    folder = _fake_plugin(tmp_path / "p")
    assert plugin.install(folder) == folder


def test_the_environment_variable_wins_over_the_default_folder(tmp_path, monkeypatch):
    monkeypatch.setenv(plugin.PLUGIN_PATH_ENV, str(tmp_path / "elsewhere"))
    assert plugin.plugin_path() == str(tmp_path / "elsewhere")


def test_the_default_folder_is_used_only_when_it_holds_the_plugin(tmp_path, monkeypatch):
    monkeypatch.delenv(plugin.PLUGIN_PATH_ENV, raising=False)
    monkeypatch.setattr(plugin, "default_dir", lambda: tmp_path / "jax-x")
    assert plugin.plugin_path() is None
    _fake_plugin(tmp_path / "jax-x")
    assert plugin.plugin_path() == str(tmp_path / "jax-x")


def test_pip_pins_both_wheels_to_the_installed_jax(tmp_path, monkeypatch):
    seen = {}

    def fake_pip(cmd, **kw):
        seen["cmd"] = cmd
        _fake_plugin(tmp_path / "t")
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(subprocess, "run", fake_pip)
    plugin.install(tmp_path / "t", quiet=True)
    v = plugin.jax_version()
    assert f"jax-cuda12-plugin=={v}" in seen["cmd"] and f"jax-cuda12-pjrt=={v}" in seen["cmd"]
    assert "--no-deps" in seen["cmd"] and str(tmp_path / "t") in seen["cmd"]


def test_a_failed_install_exits_2_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "ERROR: No matching distribution found for jax-cuda12-plugin==9.9\n"))
    assert main(["setup", "xla-gpu", "--target", str(tmp_path / "t"), "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No matching distribution" in err[-1]
    assert plugin.PLUGIN_PATH_ENV in err[-1]
