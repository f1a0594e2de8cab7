"""GET /dashboard in headless Chromium, after real load on the real engine.

Needs Debian's ``chromium`` and ``chromium-driver``: `make test` installs them (its
`browser` step, with apt where it can); the test skips, saying why, when they are
missing. The screenshot goes to $PAGODA_TEST_ARTIFACTS or test-artifacts/ (an artifact
to look at; the assertions read the page's DOM).
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
from pathlib import Path

import httpx
import pytest

from pagoda.config import EngineConfig
from tests.e2e.server_utils import running_server

MODEL = "smollm2-dashboard"
ARTIFACTS = Path(os.environ.get("PAGODA_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
CHROME_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run", "--window-size=1400,1200",
)


def _find_browser() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def ensure_chromium() -> tuple[str, str]:
    """(browser, driver) paths; else skip (`make test` installs them where it can)."""
    found = _find_browser()
    if not found:
        pytest.skip("no chromium + chromedriver on PATH (Debian: apt-get install chromium chromium-driver, "
                    "which `make browser` runs)")
    return found


@pytest.fixture(scope="module")
def server():
    from pagoda.engine.async_llm import AsyncLLM

    # A small token budget, so that the long prompt is split into visible prompt chunks.
    config = EngineConfig(show_progress=False, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=16)
    engine = AsyncLLM.from_config(config)
    with running_server(engine, served_model_name=MODEL, shutdown_engine=True) as running:
        yield running


@pytest.fixture
def driver(tmp_path):
    browser, chromedriver = ensure_chromium()
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    d = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
    d.set_page_load_timeout(60)
    try:
        yield d
    finally:
        d.quit()


def run_load(base_url: str) -> list[str]:
    """Four overlapping requests: one with a 40-token prompt (three chunks), three short."""
    jobs = [([3000 + j for j in range(40)], 6)] + [([4000 + 50 * i + j for j in range(5)], 4 + 2 * i) for i in range(3)]

    def one(job: tuple[list[int], int]) -> str:
        prompt, max_tokens = job
        r = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()["id"]

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(one, jobs))


def test_dashboard_renders_the_batching_timeline(server, driver) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    ids = run_load(server.base_url)
    page = httpx.get(f"{server.base_url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text    # nothing from the internet

    driver.get(f"{server.base_url}/dashboard")
    summary = driver.find_element(By.ID, "timeline-summary")
    WebDriverWait(driver, 60, poll_frequency=0.2).until(
        lambda _: int(summary.get_attribute("data-requests") or 0) >= len(ids)
    )
    steps = int(summary.get_attribute("data-steps"))
    assert steps >= 8                                   # the longest request alone decodes 8 tokens
    assert int(summary.get_attribute("data-prompt-cells")) >= 3 + 3   # 3 chunks of the long prompt + 3 prompts
    assert int(summary.get_attribute("data-decode-cells")) >= sum(n - 1 for n in (6, 4, 6, 8))
    shown = {li.get_attribute("data-request-id") for li in driver.find_elements(By.CSS_SELECTOR, "li.request")}
    assert set(ids) <= shown
    # The canvas has colored cells, not just a caption.
    painted = driver.execute_script(
        "const c = document.getElementById('timeline');"
        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n;"
    )
    assert painted > 100
    # The other panels are live too.
    assert driver.find_element(By.ID, "status").text == "live"
    assert driver.find_element(By.ID, "model").text == MODEL
    assert len(driver.find_elements(By.CSS_SELECTOR, "#latency tbody tr")) == 3
    assert int(driver.find_element(By.ID, "nused").text) + int(driver.find_element(By.ID, "ncached").text) \
        + int(driver.find_element(By.ID, "nfree").text) == 64

    # Every request's tokens after its first come from decode steps: the known load's.
    assert int(summary.get_attribute("data-decode-cells")) == sum(n - 1 for n in (6, 4, 6, 8))

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(ARTIFACTS / "dashboard.png"))  # for people to look at
