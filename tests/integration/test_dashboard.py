"""``/dashboard`` in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``scripts/setup.sh --dev``) driven by Selenium. The page
asks for the key, lists the agents, and a message sent from its chat box comes back and
makes the agent's row appear and grow. A screenshot is kept as the test's artifact."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from services import app_on_loopback, missing

from langchain_agent_memory.engine.model.loading import LoadedModel
from langchain_agent_memory.server import ServerConfig, create_app

KEY = "test-key"
MODEL = "smollm2-135m"


@pytest.fixture
def browser() -> Iterator[object]:
    driver_path = shutil.which("chromedriver")
    chrome = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if driver_path is None or chrome is None:
        missing("Chromium and its driver are needed (Debian: apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chrome  # type: ignore[assignment]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_dashboard_chats_with_an_agent_and_lists_it(
    browser: object, smollm: LoadedModel, tmp_path: Path, figures: dict[str, str]
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser
    config = ServerConfig(models=[MODEL], cache_dir=str(tmp_path / "cache"), api_key=KEY)
    with app_on_loopback(create_app(config)) as url:
        driver.get(f"{url}/dashboard")  # type: ignore[attr-defined]
        wait = WebDriverWait(driver, 120)
        wait.until(ec.text_to_be_present_in_element((By.ID, "models"), "401"))  # no key yet
        driver.find_element(By.ID, "key").send_keys(KEY)  # type: ignore[attr-defined]
        driver.find_element(By.ID, "save-key").click()  # type: ignore[attr-defined]
        wait.until(ec.text_to_be_present_in_element((By.ID, "models"), MODEL))
        agent = driver.find_element(By.ID, "chat-agent")  # type: ignore[attr-defined]
        agent.clear()
        agent.send_keys("dashboard agent")
        driver.find_element(By.ID, "chat-text").send_keys("Name a color.")  # type: ignore[attr-defined]
        driver.find_element(By.ID, "chat-send").click()  # type: ignore[attr-defined]
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#chat-log .reply")))
        reply = driver.find_element(By.CSS_SELECTOR, "#chat-log .reply").text  # type: ignore[attr-defined]
        assert reply.startswith("dashboard agent → ") and "(cold)" in reply
        row = '[data-agent="dashboard agent"] .tokens'
        wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, row)))
        first = int(driver.find_element(By.CSS_SELECTOR, row).text)  # type: ignore[attr-defined]
        assert first > 0
        driver.find_element(By.ID, "chat-text").send_keys("And another?")  # type: ignore[attr-defined]
        driver.find_element(By.ID, "chat-send").click()  # type: ignore[attr-defined]
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#chat-log .reply")) == 2)
        assert "(hot-extend)" in driver.find_elements(By.CSS_SELECTOR, "#chat-log .reply")[1].text  # type: ignore[attr-defined]
        wait.until(lambda d: int(d.find_element(By.CSS_SELECTOR, row).text) > first)
        wait.until(ec.text_to_be_present_in_element((By.ID, "models"), "tokens/s"))
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))  # type: ignore[attr-defined]
        assert shot.stat().st_size > 10_000
        figures["dashboard"] = f"chat and agent row checked in headless Chromium; screenshot {shot}"
