"""Every test runs in a directory of its own, so that what a run writes where it stands (Lightning's
``checkpoints/`` and ``lightning_logs/`` when a test gives no ``default_root_dir``) never lands in the repository.
Ranks a test starts inherit it."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _in_a_directory_of_its_own(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))

