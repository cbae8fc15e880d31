"""``kvgen.paths``: every directory and knob, each with its precedence (argument, environment,
default), from an explicit ``environ`` mapping (the process environment is never touched)."""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

import pytest

from kvgen import paths
from kvgen.arch import ArchError
from tests import test_architecture as architecture


def test_specs_dir_argument_then_environment_then_local_then_package(tmp_path, monkeypatch):
    env = {"KVGEN_SPECS_DIR": "/env/specs"}
    assert paths.specs_dir("/arg/specs", env) == Path("/arg/specs")
    assert paths.specs_dir(None, env) == Path("/env/specs")
    monkeypatch.chdir(tmp_path)
    assert paths.specs_dir(None, {}) == paths.PACKAGE_ROOT / "specs"
    (tmp_path / "specs").mkdir()
    assert paths.specs_dir(None, {}) == Path("specs")
    assert paths.spec_path("qwen3-8b", None, env) == Path("/env/specs/qwen3-8b.yaml")


def test_project_directories_follow_the_project_root(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert paths.project_root() == paths.PACKAGE_ROOT          # no specs/ here: the package's checkout
    (tmp_path / "specs").mkdir()
    (tmp_path / "build" / "registry-score-b").mkdir(parents=True)
    (tmp_path / "build" / "registry-score-a").mkdir()
    assert paths.project_root() == tmp_path
    assert paths.generated_dir() == tmp_path / "generated" and paths.generated_dir("g") == Path("g")
    assert paths.registry_dir() == tmp_path / "build" / "registry" and paths.registry_dir("r") == Path("r")
    assert paths.tuning_dir() == tmp_path / "tuning" and paths.tuning_dir("t") == Path("t")
    assert paths.score_variant_registries() == [tmp_path / "build" / "registry-score-a",
                                                tmp_path / "build" / "registry-score-b"]


def test_registry_search_path_arguments_then_environment():
    env = {"KVGEN_REGISTRY": os.pathsep.join(["/e1", "", "/e2"])}
    assert paths.registry_search_path(["/a", Path("/b")], env) == [Path("/a"), Path("/b"), Path("/e1"), Path("/e2")]
    assert paths.registry_search_path((), {}) == []


def test_cache_and_results_directories():
    assert paths.cache_dir("/c", {"KVGEN_CACHE_DIR": "/e"}) == Path("/c")
    assert paths.cache_dir(None, {"KVGEN_CACHE_DIR": "/e"}) == Path("/e")
    assert paths.cache_dir(None, {}) == Path.home() / ".cache" / "kvgen"
    assert paths.results_dir("/r", {"OUT": "/o"}) == Path("/r")
    assert paths.results_dir(None, {"OUT": "/o"}) == Path("/o")
    assert paths.results_dir(None, {}) == Path("results")
    noon = datetime.datetime(2026, 1, 2, 12, 0, 5)
    assert paths.run_dir("bench", None, {}, now=noon) == Path("results/bench-20260102-120005")
    assert paths.run_dir("bench", None, {"OUT": "/o"}, now=noon) == Path("/o")
    assert paths.run_dir("bench", "/x", {"OUT": "/o"}, now=noon) == Path("/x")


@pytest.mark.parametrize("value, jobs", [("3", 3), ("0", None), ("-2", None), ("many", None), ("", None)])
def test_max_jobs_takes_only_a_positive_integer(value, jobs):
    assert paths.max_jobs({"MAX_JOBS": value}) == (jobs or os.cpu_count() or 1)


def test_knobs():
    assert paths.cuda_arch_list({"KVGEN_CUDA_ARCH_LIST": " sm_90a, sm_100f ,"}) == ["sm_90a", "sm_100f"]
    assert paths.cuda_arch_list({}) == []
    for off in ("off", "OFF", "0", "no", "false"):
        assert not paths.tuning_enabled({"KVGEN_TUNING": off})
    assert paths.tuning_enabled({}) and paths.tuning_enabled({"KVGEN_TUNING": "on"})
    assert paths.tuned_params_override({"KVGEN_TUNED_PARAMS": "f:codec:threads=128"}) == "f:codec:threads=128"
    assert paths.tuned_params_override({}) == ""
    assert paths.commit({"KVGEN_COMMIT": "abc1234"}) == "abc1234" and paths.commit({"KVGEN_COMMIT": ""}) is None
    assert paths.cute_dsl_arch({"CUTE_DSL_ARCH": "sm_90a"}) == "sm_90a" and paths.cute_dsl_arch({}) is None
    search = paths.toolchain_search({"PATH": "/bin", "KVGEN_NVCC": "/n/nvcc", "CUDA_HOME": ""})
    assert search == paths.ToolchainSearch(path="/bin", nvcc="/n/nvcc", cuda_home=None)


def test_child_environment_is_a_copy_plus_extras():
    base = {"PATH": "/bin"}
    child = paths.child_environ(base, PYTHONUNBUFFERED="1")
    assert child == {"PATH": "/bin", "PYTHONUNBUFFERED": "1"} and base == {"PATH": "/bin"}


@pytest.mark.parametrize("value", ["9.0a;sm_100a", "90a sm_100a", "sm_90a,10.0a", "sm_90a;;sm_100a;sm_90a"])
def test_cuda_arch_list_takes_the_torch_spellings_and_separators(value):
    assert paths.cuda_arch_list({"KVGEN_CUDA_ARCH_LIST": value}) == ["sm_90a", "sm_100a"]


@pytest.mark.parametrize("value", ["9.0", "sm_89", "sm_120", "sm90a", "8.0;sm_90a"])
def test_a_bad_cuda_arch_list_names_the_variable_and_the_accepted_values(value):
    with pytest.raises(ArchError, match=r"^\$KVGEN_CUDA_ARCH_LIST: .*accepted: sm_90a, sm_100a"):
        paths.cuda_arch_list({"KVGEN_CUDA_ARCH_LIST": value})


def test_paths_imports_only_the_other_base_modules():
    assert architecture.imported_modules(paths.PACKAGE_ROOT / "kvgen" / "paths.py") <= architecture.BASE_MODULES


ENVIRON_USE = re.compile(r"\bos\.(environ|getenv|putenv|unsetenv)\b|\bgetenv\(|\bfrom os import [^\n]*\b(environ|getenv)\b")


def test_paths_is_the_only_module_reading_or_writing_the_environment():
    """Every knob is resolved in ``kvgen.paths`` and passed down as an argument; a worker's
    environment is built by ``paths.child_environ``."""
    root = paths.PACKAGE_ROOT / "kvgen"
    users = [str(f.relative_to(root)) for f in sorted(root.rglob("*.py"))
             if f != root / "paths.py" and ENVIRON_USE.search(f.read_text(encoding="utf-8"))]
    assert users == [], f"read the environment through kvgen.paths: {users}"


def test_the_environment_grep_sees_every_spelling():
    for line in ("x = os.environ['A']", "os.getenv('A')", "os.environ.get('A')", "from os import environ",
                 "from os import path, getenv", "os.putenv('A', 'b')"):
        assert ENVIRON_USE.search(line), line
    assert not ENVIRON_USE.search("paths.child_environ(environ)")
