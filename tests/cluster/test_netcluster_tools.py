"""The simulated cluster's script on a machine without iproute2 (no ``ip``, no ``tc``):
one clear error before anything is made. Needs neither root nor namespaces, so it runs
in the default suite (``test_netcluster.py`` needs both and runs with ``-m netcluster``).
"""

from __future__ import annotations

import pytest


def test_missing_tools_are_named_before_anything_is_made(tmp_path, monkeypatch):
    """Without ``ip`` and ``tc`` on the PATH (a machine without iproute2), making a cluster
    fails at once with one error naming them and the package, not a ``FileNotFoundError``
    from its cleanup; cleaning up finds nothing to remove."""
    import shutil

    from benchmarks.netcluster import NetCluster, clean, namespaces, net

    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "timeout").symlink_to(shutil.which("timeout"))  # coreutils stays
    monkeypatch.setenv("PATH", str(bare))
    with pytest.raises(RuntimeError) as info:
        NetCluster([{"threads": 1}], lock_wait=1)
    message = str(info.value)
    assert "`ip`" in message and "`tc`" in message and "iproute2" in message, message
    assert "timeout" not in message.split("needs", 1)[1], message
    assert clean() == [] and namespaces() == []
    assert "iproute2" in net.unavailable()
