"""The API reference (mkdocs.yml: the guides of docs/ and docs/api/, built from the
docstrings) builds strictly, and documents every public name of ``precision`` and ``train``."""

import re
import subprocess
import sys

import pytest

import precision
import train
from helpers import ROOT

pytest.importorskip("mkdocstrings", reason="the API reference needs the docs extra: pip install '.[docs]'")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                             "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]  # strict: any warning fails the build
    return out


@pytest.mark.parametrize("package", [precision, train], ids=lambda p: p.__name__)
def test_every_public_name_is_documented_from_its_docstring(site, package):
    page = (site / "api" / package.__name__ / "index.html").read_text()
    anchors = set(re.findall(r'id="([\w.]+)"', page))
    missing = [name for name in package.__all__
               if not any(a == f"{package.__name__}.{name}" or a.endswith(f".{name}") for a in anchors)]
    assert missing == []


def test_the_names_users_look_up_first_have_their_docstrings(site):
    text = {p: (site / "api" / p / "index.html").read_text() for p in ("precision", "train")}
    for package, name in [("precision", "get_policy"), ("precision", "mixed_precision"),
                          ("precision", "with_policy"), ("train", "create_train_state"), ("train", "make_train_step")]:
        assert f'id="{package}.{name}"' in text[package], name
        summary = getattr(sys.modules[package], name).__doc__.strip().splitlines()[0].split("``")[0][:30]
        assert summary.split()[0] in text[package]


def test_the_guides_are_pages_of_the_site(site):
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert (site / page.stem / "index.html").exists(), page.name
