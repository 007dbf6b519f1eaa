"""The probe refuses storage libraries outside the tested range, naming the package and the version."""

from __future__ import annotations

import importlib.metadata

import pytest

from dflash_pipeline.errors import CompatError
from dflash_pipeline.extraction.probe import check_storage_libraries


def test_installed_storage_libraries_are_in_the_tested_range():
    assert set(check_storage_libraries()) == {"zarr", "numcodecs"}


@pytest.mark.parametrize(("pkg", "version"), [("zarr", "2.18.3"), ("zarr", "4.0.0"), ("numcodecs", "0.12.1")])
def test_an_untested_storage_library_is_refused_by_name(monkeypatch, pkg, version):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: version if name == pkg else real(name))
    with pytest.raises(CompatError, match=rf"{pkg} {version} is installed.*pip install '{pkg}>="):
        check_storage_libraries()
