"""`python -m tunekit_course.unsloth_site`: the folder holds what Unsloth's requirements ask for and the environment
lacks, never a torch-bound package, and a bad `pip freeze` or a cross build without one is refused saying why.
(No download here: the wheels' metadata is written by hand.)"""

from __future__ import annotations

import pytest

from tunekit_course import unsloth_site


def wheel(site, name, version, *requires):
    meta = site / f"{name}-{version}.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))


def test_what_is_missing_is_what_neither_the_folder_nor_the_environment_satisfies(tmp_path):
    wheel(tmp_path, "unsloth", "2026.10.9", "unsloth_zoo>=2026.10.9", "datasets<5.0.0,>=3.4.1", "peft>=0.18.0",
          "xformers>=0.0.27", "tyro", 'mlx==0.32.4; sys_platform == "darwin"', 'pytest; extra == "dev"')
    wheel(tmp_path, "unsloth_zoo", "2026.10.9", "datasets!=4.4.*,<5.0.0", "trl<=1.15.0,>=0.18.2", "peft>=0.18.0")
    have = {"datasets": "5.2.0", "peft": "0.21.0", "trl": "1.16.0", "tyro": "1.0.17"}
    todo, left = unsloth_site.missing(unsloth_site.in_site(tmp_path), have, unsloth_site.marker_env("3.12"))
    # datasets: both packages' specifiers joined, since the environment's 5.2.0 fails them; trl likewise;
    # peft and tyro are met by the environment, unsloth_zoo by the folder; mlx is macOS only, pytest an extra
    assert set(todo) == {"datasets", "trl"}
    assert todo["datasets"].specifier.contains("4.3.0") and not todo["datasets"].specifier.contains("4.4.1")
    assert not todo["datasets"].specifier.contains("5.0.0") and str(todo["trl"].specifier) == "<=1.15.0,>=0.18.2"
    assert set(left) == {"xformers"} and "torch" in left["xformers"]


def test_a_package_the_folder_holds_at_a_refused_version_is_fetched_again(tmp_path):
    wheel(tmp_path, "unsloth", "1", "transformers<=5.17.0")
    wheel(tmp_path, "transformers", "5.20.0")
    todo, _ = unsloth_site.missing(unsloth_site.in_site(tmp_path), {}, unsloth_site.marker_env(None))
    assert list(todo) == ["transformers"]


def test_a_freeze_is_read_by_canonical_name_and_a_bad_line_is_refused_by_number(tmp_path):
    good = tmp_path / "freeze.txt"
    good.write_text("# a comment\nTorch==2.11.0+cu130\nhuggingface_hub==1.33.0\n-e git+https://x/y#egg=z\n"
                    "tunekit-course @ file:///srv/x\n")
    assert unsloth_site.read_freeze(good) == {"torch": "2.11.0+cu130", "huggingface-hub": "1.33.0"}
    bad = tmp_path / "bad.txt"
    bad.write_text("torch==2.11.0\ntransformers>=5\n")
    with pytest.raises(ValueError, match=r"bad.txt, line 2: 'transformers>=5' is not NAME==VERSION"):
        unsloth_site.read_freeze(bad)


def test_only_this_cuda_releases_bitsandbytes_library_is_kept(tmp_path):
    bnb = tmp_path / "bitsandbytes"
    bnb.mkdir()
    for lib in ("libbitsandbytes_cuda124.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda1301.so",
                "libbitsandbytes_cpu.so", "libbitsandbytes_rocm72.so", "libbitsandbytes_xpu2026.so"):
        (bnb / lib).write_bytes(b"x" * 10)
    assert unsloth_site._keep_cuda(tmp_path, "130") == 40
    assert sorted(p.name for p in bnb.iterdir()) == ["libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so"]


def test_a_build_for_another_machine_needs_its_freeze(capsys):
    with pytest.raises(SystemExit):
        unsloth_site.main(["--python-version", "3.12"])
    assert "pip freeze" in capsys.readouterr().err


def test_the_folder_being_rebuilt_does_not_count_as_the_environment(tmp_path, monkeypatch):
    wheel(tmp_path, "datasets", "4.3.0")  # an earlier build on the path, as `compare` puts it there
    monkeypatch.syspath_prepend(str(tmp_path))
    assert unsloth_site.installed_here()["datasets"] == "4.3.0"
    assert unsloth_site.installed_here(apart=tmp_path).get("datasets") != "4.3.0"
