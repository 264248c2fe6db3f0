"""Which installed distribution provides a module, checked against `importlib.metadata` on every
distribution installed in the test environment, and what identifies library code in a key.

What upgrades, downgrades and local installs do to keys, in a real venv: tests/test_cache_libraries.py.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys

from hardy.hashing.distributions import PYTHON, module_identity, normalize, site_of


def test_every_installed_module_belongs_to_the_distribution_importlib_metadata_names():
    """The shortcut (a distribution named as the module, found by listing the site directory) and
    the RECORDs read for other names agree with `packages_distributions()` for each top-level
    module installed here (namespace packages, spread over several distributions, are left to the
    venv tests)."""
    expected = importlib.metadata.packages_distributions()
    checked = []
    for top, dists in sorted(expected.items()):
        try:
            spec = importlib.util.find_spec(top)  # a top-level name: no code runs
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not os.path.isabs(spec.origin):
            continue
        located = site_of(spec.origin)
        if located is None or "-packages" not in located[0].root:
            continue  # not installed into a site directory (hardy itself, here, is on PYTHONPATH)
        owner = located[0].owner(located[1])
        assert owner is not None, top
        assert owner.name in {normalize(d) for d in dists}, (top, owner.name, dists)
        checked.append(top)
    assert len(checked) > 50, checked


def test_a_library_is_keyed_by_its_version_and_the_versions_it_requires():
    """Each by its name, version and a digest of the files its RECORD hashes (tests/test_wheel_keys.py)."""
    import sklearn.linear_model  # noqa: F401
    found = module_identity("sklearn.linear_model").decode()
    versions = dict(part.split("#record:")[0].split("==") for part in found.split(";"))
    for dist in ("scikit-learn", "numpy", "scipy"):
        assert versions[normalize(dist)] == importlib.metadata.version(dist), found
    assert all("#record:" in part for part in found.split(";")), found


def test_the_standard_library_and_builtins_are_keyed_by_the_python_version():
    version = ".".join(map(str, sys.version_info[:3]))
    assert version in PYTHON
    for name in ("json", "math", "sys", "builtins", "_io", "posixpath"):
        assert module_identity(name) == PYTHON.encode(), name


def test_a_library_not_imported_is_found_without_importing_it():
    """A library imported only inside a node (`import docker` there) is keyed by its distribution,
    found by its import spec: it is not imported to key the node."""
    assert "docker" not in sys.modules
    assert f"docker=={importlib.metadata.version('docker')}" in module_identity("docker.models.containers").decode()
    assert "docker" not in sys.modules
