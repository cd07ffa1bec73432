"""A headless Chromium for the web page's tests, from wherever one can be had.

In order: ``$PYMTP_CHROMIUM`` (a path: it must work), Playwright's own build (in its
cache, ``~/.cache/ms-playwright``), a Chromium or Chrome on PATH (Debian's ``chromium``
package), and last a one-time ``python -m playwright install chromium`` into Playwright's
cache. Only when all of them fail is the test skipped, with every reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

SYSTEM_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
INSTALL_TIMEOUT = 240
_install_failed: list[str] = []     # a failed install is not tried again by the next test


def launch_chromium(playwright):
    """A launched headless Browser, or a pytest skip saying why none could be had."""
    from playwright.sync_api import Error

    explicit = os.environ.get("PYMTP_CHROMIUM")
    if explicit:
        return playwright.chromium.launch(executable_path=explicit)
    reasons = []
    try:
        return playwright.chromium.launch()
    except Error as exc:
        reasons.append(f"Playwright's own Chromium: {_first_line(exc)}")
    for name in SYSTEM_BROWSERS:
        path = shutil.which(name)
        if path is None:
            continue
        try:
            return playwright.chromium.launch(executable_path=path)
        except Error as exc:
            reasons.append(f"{path}: {_first_line(exc)}")
    if not any(shutil.which(n) for n in SYSTEM_BROWSERS):
        reasons.append(f"no {' / '.join(SYSTEM_BROWSERS)} on PATH")
    if _install_failed:
        pytest.skip(_install_failed[0])
    try:
        done = subprocess.run([sys.executable, "-m", "playwright", "install", "chromium"],
                              capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    except subprocess.TimeoutExpired:
        reasons.append(f"`playwright install chromium` took over {INSTALL_TIMEOUT} s")
    else:
        if done.returncode == 0:
            return playwright.chromium.launch()
        lines = (done.stderr + done.stdout).strip().splitlines()
        why = next((line for line in lines if "Error" in line), lines[-1] if lines else f"exit {done.returncode}")
        reasons.append(f"`playwright install chromium` failed: {why.strip()}")
    _install_failed.append("no headless Chromium could be had (set PYMTP_CHROMIUM, `apt-get install chromium` "
                           "or `python -m playwright install chromium`): " + "; ".join(reasons))
    pytest.skip(_install_failed[0])


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
