"""Fixtures for the Slurm launcher tests: one real single-node cluster per test session.

The cluster needs Debian's slurmctld, slurmd, slurm-client and munge packages (installed by
.ci/install_slurm.sh, which the fixture runs when they are missing) and root; without them every
test here is skipped with the reason.
"""
from __future__ import annotations

import pytest
from slurm_cluster import SlurmCluster, ensure_installed


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = ensure_installed()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(cpus=2).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """Folder for the demo's tiny model and synthetic data; the first training job creates them."""
    return tmp_path_factory.mktemp("demo_assets")
