"""Screenshots of sudu bench's HTML pages for docs/images/: the top of a report page (headline card and the
first charts) rendered in Debian's chromium through playwright (never `playwright install`).

    python -m benchmarks.bench_report_screenshots REPORT.html docs/images/bench-report-replay.png
    python -m benchmarks.bench_report_screenshots AB.html docs/images/bench-compare.png --height 700
"""
from __future__ import annotations

import argparse
import os

from playwright.sync_api import sync_playwright

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("html")
    p.add_argument("png")
    p.add_argument("--width", type=int, default=1240)
    p.add_argument("--height", type=int, default=1000)
    p.add_argument("--scroll-to", default=None, help="a CSS selector to scroll into view first")
    args = p.parse_args()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS)
        page = browser.new_page(viewport={"width": args.width, "height": args.height})
        page.goto("file://" + os.path.abspath(args.html))
        page.wait_for_selector(".js-plotly-plot .main-svg")
        if args.scroll_to:
            page.locator(args.scroll_to).first.scroll_into_view_if_needed()
        page.screenshot(path=args.png)
        browser.close()


if __name__ == "__main__":
    main()
