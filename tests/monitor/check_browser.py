"""Loads the monitor page of a run that is still training in headless Chromium (Selenium and
chromedriver from Debian), waits until the page shows a step that was written to metrics.jsonl
after the page had loaded, checks that the charts hold points, and saves a screenshot.
Usage: check_browser.py URL METRICS_JSONL SCREENSHOT.png [--settle-val N]
       check_browser.py --overlay URL NAME...   (several runs on one page)"""
import json
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service


def max_step(path):
    step = -1
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except ValueError:
                continue  # the line being written
            step = max(step, r.get("step", -1))
    return step


def read_card(driver):
    card = driver.execute_script(
        "const c = document.querySelector(\".run[data-run='0']\");"
        "return c ? [Number(c.dataset.step), c.dataset.state, c.innerText] : null")
    return tuple(card) if card else None


def start_driver():
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1500,1250",
              "--hide-scrollbars", "--force-device-scale-factor=1"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def main(url, metrics, screenshot, settle_val=0):
    driver = start_driver()
    try:
        driver.set_page_load_timeout(60)
        driver.get(url)
        loaded_step = max_step(metrics)  # everything written up to here may be in the first answer
        print(f"page loaded; metrics.jsonl had reached step {loaded_step}")
        deadline = time.time() + 90
        shown = -1
        state = text = None
        while time.time() < deadline:
            card = read_card(driver)  # the page redraws its cards on every poll: read one in one go
            if card:
                shown, state, text = card
                if shown > loaded_step:
                    break
            time.sleep(0.2)
        assert shown > loaded_step, f"the page still shows step {shown}, not past {loaded_step} written before it loaded"
        print(f"the page shows step {shown} (written after it loaded), state '{state}'")
        assert state == "training", f"state {state}"
        # Optional, for a screenshot worth reading: wait for a few evaluations to be drawn.
        while settle_val and time.time() < deadline + 120:
            n = driver.execute_script("return Chart.getChart('c-acc').data.datasets[1].data.length")
            if n >= settle_val:
                break
            time.sleep(0.5)
        points = driver.execute_script(
            "return ['c-loss','c-acc','c-lr','c-ips','c-wait'].map(id => "
            "Chart.getChart(id).data.datasets.reduce((n, d) => n + d.data.length, 0))")
        print(f"points per chart (loss, accuracy, lr, images/s, data-wait): {points}")
        assert all(p > 0 for p in points), points
        assert "step" in text and "ETA" in text, text
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, f"console errors: {errors}"
        driver.save_screenshot(screenshot)
        print(f"screenshot: {screenshot}")
    finally:
        driver.quit()


def overlay(url, names):
    """Several runs on one page (`stoke monitor A B`): a card per run with its state, every chart
    holding a series per run, and the wall-clock axis drawing them too."""
    driver = start_driver()
    try:
        driver.get(url)
        deadline = time.time() + 60
        cards = []
        while time.time() < deadline:
            cards = driver.execute_script(
                "return [...document.querySelectorAll('.run')].map(c => [c.dataset.state, Number(c.dataset.step), "
                "c.querySelector('.name').textContent])")
            if len(cards) == len(names) and all(c[1] > 0 for c in cards):
                break
            time.sleep(0.2)
        print(f"cards: {cards}")
        assert [c[2] for c in cards] == names, cards
        assert cards[0][0] == "finished", cards
        for axis in ("step", "time"):
            driver.execute_script(
                f"const s = document.getElementById('xaxis'); s.value = '{axis}'; s.dispatchEvent(new Event('change'))")
            per_run = driver.execute_script(
                "return Chart.getChart('c-loss').data.datasets.filter(d => d.label.endsWith('train loss'))"
                ".map(d => d.data.length)")
            print(f"x axis {axis}: train-loss points per run {per_run}")
            assert len(per_run) == len(names) and all(n > 0 for n in per_run), per_run
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, f"console errors: {errors}"
    finally:
        driver.quit()


if __name__ == "__main__":
    if sys.argv[1] == "--overlay":
        overlay(sys.argv[2], sys.argv[3:])
        sys.exit(0)
    settle = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[4] == "--settle-val" else 0
    main(sys.argv[1], sys.argv[2], sys.argv[3], settle)
