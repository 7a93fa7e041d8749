"""Headless Debian Chromium driven by Playwright, for the report and viewer tests.

The browser is the system's `/usr/bin/chromium` (scripts/setup.sh installs it with apt);
Playwright's own browser download is never used. Screenshots go to $TILLER_TEST_ARTIFACTS
(default tests/artifacts/, git-ignored), kept after the run for a person to look at.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def artifacts_dir() -> Path:
    path = Path(os.environ.get("TILLER_TEST_ARTIFACTS",
                               Path(__file__).parent / "artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def chromium_page(user_data_dir: Path) -> Iterator:
    """A fresh page in headless Chromium with its own profile under `user_data_dir`; fails the
    test (not skips it) when the browser or Playwright is missing: setup.sh installs both."""
    if not shutil.which(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: run scripts/setup.sh as root (apt install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(user_data_dir), executable_path=CHROMIUM, args=ARGS, headless=True,
            viewport={"width": 1400, "height": 1000})
        try:
            page = context.new_page()
            page.set_default_timeout(20_000)
            yield page
        finally:
            context.close()
