"""The Prefect UI in a real browser: headless Chromium (Debian's package) driven by Playwright's Python API to a
finished `full` run's page on the PostgreSQL-backed server (tests/e2e/conftest.py::pg_full_run).

Playwright rather than the DevTools protocol by hand: its locators wait for the single-page app to render (no
sleeps), and `pip install playwright` downloads no browser; it drives the system's /usr/bin/chromium through
`executable_path`. Screenshots go to $DFLASH_TEST_SCREENSHOTS when set (CI keeps them), else to the test's tmp dir;
their paths are printed.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from dflash_pipeline.tasks.common import artifact_key
from tests.serving import api

CHROMIUM_FLAGS = [
    "--no-sandbox",  # we run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",  # no connections to Google's hosts (this machine's network is closed)
    "--disable-component-update",
    "--disable-sync",
]


def _chromium() -> str:
    path = os.environ.get("DFLASH_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.skip("no Chromium installed: apt-get install chromium (.ci/run does), or set DFLASH_CHROMIUM")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the playwright package is missing: pip install -e '.[test]'")
    return path


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser's path; skips (saying why) before any server is started for nothing (session-scoped, so it
    is set up before the session's PostgreSQL and server fixtures)."""
    return _chromium()


@pytest.fixture
def page(chromium):
    """A fresh headless Chromium page (own profile dir); the browser is closed whatever the test does."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_FLAGS)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            context.set_default_timeout(60_000)
            yield context.new_page()
        finally:
            browser.close()


def _shots_dir(tmp_path: Path) -> Path:
    d = Path(os.environ["DFLASH_TEST_SCREENSHOTS"]) if os.environ.get("DFLASH_TEST_SCREENSHOTS") else tmp_path
    d.mkdir(parents=True, exist_ok=True)
    return d


def _artifact_ids(lp, run_id) -> dict[str, str]:
    async def go(client):
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        arts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id]))
        )
        return {a.key: str(a.id) for a in arts if a.key}

    return api(lp, go)


def test_a_finished_run_page_shows_its_task_runs_and_artifacts(chromium, pg_full_run, page, tmp_path):
    from playwright.sync_api import expect

    lp, fr, out = pg_full_run
    assert fr.state.is_completed(), fr.state
    shots = _shots_dir(tmp_path)
    ui = lp.api_url.removesuffix("/api")
    saved = []

    def shot(name: str) -> None:
        path = shots / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        saved.append(path)

    # The run's page: its name and state, then the task runs tab lists every stage's task run.
    page.goto(f"{ui}/runs/flow-run/{fr.id}", wait_until="networkidle")
    expect(page.get_by_text(fr.name).first).to_be_visible()
    expect(page.get_by_text("Completed").first).to_be_visible()
    expect(page.get_by_text("Can't connect to Server API")).to_have_count(0)
    shot("1-flow-run")
    page.get_by_text("Task Runs", exact=True).first.click()
    for name in ("prepare ", "probe ", "extract ", "validate ", "train drafter", "acceptance on held-out prompts"):
        expect(page.get_by_text(re.compile(re.escape(name))).first).to_be_visible()
    shot("2-task-runs")

    # The artifacts tab lists the project's artifacts; each opens on its own page.
    # Their keys are this store's own (artifact_key's suffix), so the Artifacts page's latest is this store's.
    page.get_by_text("Artifacts", exact=True).first.click()
    names = ("extract-throughput", "train-loss-curve", "store", "run-summary", "validation", "compat-probe")
    key = {name: artifact_key(name, store=str(out / "store")) for name in names}
    for name in names:
        expect(page.get_by_text(key[name], exact=True).first).to_be_visible()
    shot("3-artifacts")

    ids = _artifact_ids(lp, fr.id)
    page.get_by_text(key["extract-throughput"], exact=True).first.click()
    page.wait_for_url(f"**/artifacts/artifact/{ids[key['extract-throughput']]}")
    rows = page.locator("table tbody tr")
    expect(rows.filter(has_text="total (all workers)")).to_have_count(1)
    expect(rows.filter(has_text="cpu").first).to_be_visible()
    assert rows.count() >= 2, rows.all_inner_texts()
    shot("4-throughput-table")

    page.goto(f"{ui}/artifacts/artifact/{ids[key['train-loss-curve']]}", wait_until="networkidle")
    img = page.locator('img[alt="loss curve"]')
    expect(img).to_have_count(1)
    img.scroll_into_view_if_needed()
    page.wait_for_function("img => img.complete && img.naturalWidth > 0", arg=img.element_handle())
    width, height = img.evaluate("img => [img.naturalWidth, img.naturalHeight]")
    assert width >= 300 and height >= 200, (width, height)  # the plot itself, not a broken-image icon
    shot("5-loss-curve")

    page.goto(f"{ui}/artifacts/artifact/{ids[key['store']]}", wait_until="networkidle")
    expected = (out / "store" / "v0001").absolute().as_uri()
    link = page.locator(f'a[href="{expected}"]')
    expect(link.first).to_be_visible()
    assert expected.startswith("file:///")  # absolute: opens from the UI whatever page it is on
    shot("6-store-link")

    print("screenshots:", *saved, sep="\n  ")
    assert all(p.stat().st_size > 10_000 for p in saved)
