"""``/dashboard`` in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``scripts/setup.sh --dev``) driven by Selenium. Before a
key the page is a login view (not the API's 401 JSON); with it, a message sent from its chat
box comes back and makes the agent's row appear and grow, the charts over time draw that
turn (time to first token by outcome, the hot / warm / cold share, tokens reused against
prefilled, the disk), a reload keeps the transcript (the next turn still extends the
agent's cache), and the agents are paged and searched. A screenshot is kept as the test's
artifact."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from services import app_on_loopback, missing

from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.server import ServerConfig, create_app

KEY = "test-key"
MODEL = "smollm2-135m"
FORKS = 30  # over one page (25) of the list


@pytest.fixture
def browser() -> Iterator[Any]:
    driver_path = shutil.which("chromedriver")
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if driver_path is None or chrome is None:
        missing("Chromium and its driver are needed (Debian: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chrome  # type: ignore[assignment]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _chat(driver: Any, wait: Any, text: str, replies: int) -> str:
    from selenium.webdriver.common.by import By

    driver.find_element(By.ID, "chat-text").send_keys(text)
    driver.find_element(By.ID, "chat-send").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chat-log .reply")) == replies)
    return driver.find_elements(By.CSS_SELECTOR, "#chat-log .reply")[-1].text


def test_the_dashboard_chats_charts_and_pages(
    browser: Any, smollm: LoadedModel, tmp_path: Path, figures: dict[str, str]
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    config = ServerConfig(models=[MODEL], cache_dir=str(tmp_path / "cache"), api_key=KEY)
    with app_on_loopback(create_app(config)) as url:
        driver.get(f"{url}/dashboard")
        wait = WebDriverWait(driver, 120)
        # No key yet: the login view, and nothing of the API's 401 body on the page.
        wait.until(ec.visibility_of_element_located((By.ID, "login-view")))
        assert "API key" in driver.find_element(By.ID, "login-view").text
        assert not driver.find_element(By.ID, "main").is_displayed()
        assert "401" not in driver.find_element(By.TAG_NAME, "body").text
        driver.find_element(By.ID, "key").send_keys("wrong")
        driver.find_element(By.ID, "save-key").click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "login-error"), "refused"))
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.ID, "save-key").click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "models"), MODEL))
        assert not driver.find_element(By.ID, "login-view").is_displayed()

        agent = driver.find_element(By.ID, "chat-agent")
        agent.clear()
        agent.send_keys("dashboard agent")
        first_reply = _chat(driver, wait, "Name a color.", 1)
        assert first_reply.startswith("dashboard agent → ") and "(cold)" in first_reply
        row = '[data-agent="dashboard agent"]'
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, row + " .tokens")))
        first = int(driver.find_element(By.CSS_SELECTOR, row + " .tokens").text)
        assert first > 0
        assert "(hot-extend)" in _chat(driver, wait, "And another?", 2)
        wait.until(lambda d: int(d.find_element(By.CSS_SELECTOR, row + " .tokens").text) > first)
        wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, row + " .hot-rate"), "50 % of 2"))

        # The charts draw both turns: a cold and a hot-extend time to first token, hot and
        # cold shares, reused and prefilled tokens, the disk sampled.
        for css in (
            '[data-chart="ttft"] path[data-series="cold"]',
            '[data-chart="ttft"] path[data-series="hot-extend"]',
            '[data-chart="share"] rect[data-series="hot"]',
            '[data-chart="share"] rect[data-series="cold"]',
            '[data-chart="tokens"] rect[data-series="reused"]',
            '[data-chart="tokens"] rect[data-series="prefilled"]',
            '[data-chart="disk"] path[data-series="disk"]',
        ):
            wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, css)))
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000

        # A reload keeps the transcript, and sends it whole: the third turn extends the cache
        # (a transcript lost would send the new message alone: a diverge).
        driver.refresh()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chat-log .reply")) == 2)
        wait.until(ec.text_to_be_present_in_element((By.ID, "models"), MODEL))  # the tab's key kept
        assert driver.find_element(By.ID, "chat-agent").get_attribute("value") == "dashboard agent"
        assert "(hot-extend)" in _chat(driver, wait, "One more?", 3)

        # Paged and searched: forks of the agent over a page.
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}) as client:
            for i in range(FORKS):
                fork = f"/v1/agents/dashboard agent/fork?model={MODEL}"
                r = client.post(fork, json={"to": f"fork-{i:02d}"})
                assert r.status_code == 200, r.text
        rows = "table.agents tbody tr"
        wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, ".pager"), f"of {FORKS + 1}"))
        assert len(driver.find_elements(By.CSS_SELECTOR, rows)) == 25
        driver.find_element(By.CSS_SELECTOR, '.pager button[data-page="1"]').click()
        wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, ".pager"), f"26–{FORKS + 1}"))
        assert len(driver.find_elements(By.CSS_SELECTOR, rows)) == FORKS + 1 - 25
        driver.find_element(By.ID, "agent-search").send_keys("fork-1")
        wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, ".pager"), "1–10 of 10 matching"))
        ids = {r.get_attribute("data-agent") for r in driver.find_elements(By.CSS_SELECTOR, rows)}
        assert ids == {f"fork-1{i}" for i in range(10)}
        checked = "login, chat, charts, reload and paging checked in headless Chromium"
        figures["dashboard"] = f"{checked}; screenshot {shot}"
