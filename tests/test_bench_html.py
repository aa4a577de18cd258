"""sudu bench's HTML report in a real headless browser (Debian's chromium, driven by playwright with its
executable path; no browser download): the page loads with no console error and no network request (all
of plotly.js is inside it), the headline card shows the run's own figures, and a chart answers a hover.
The replay page shows per-session timelines, the compare page the A/B ratios with their verdicts."""
import json
import os
import shutil

import pytest

from sudu.bench.fake_server import FakeServer, chat_script
from tests.helpers.bench_cli import run_cli as run_cli_here
from tests.helpers.prefix_caches import PrefixCache

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

playwright_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (in [test])")
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM) or shutil.which("chromium") is None,
                                reason="Debian's chromium is not installed (apt-get install chromium; .ci/run does)")


def script(body):
    n = 6
    pieces = [(0.004 + 0.001 * i, f" w{i}") for i in range(n)]
    usage = {"prompt_tokens": 50, "completion_tokens": n, "total_tokens": 50 + n,
             "prompt_tokens_details": {"cached_tokens": 0}}
    return chat_script(pieces, usage=usage, model=body.get("model", "fake"))


def run_cli(argv):
    """The CLI in a thread of its own: playwright's sync API holds this thread's event loop."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run_cli_here, argv).result()


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def open_page(browser, path):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems, requests = [], []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("request", lambda r: requests.append(r.url))
    url = "file://" + str(path)
    page.goto(url)
    page.wait_for_selector(".js-plotly-plot .main-svg", timeout=30000)
    return page, problems, [r for r in requests if r != url]


def hover_first_point(page, chart_id):
    """Move the mouse onto the middle point of the chart's first trace; return the hover label's text."""
    x, y = page.evaluate("""(id) => {
        const gd = document.getElementById(id), t = gd._fullData[0], xa = gd._fullLayout.xaxis, ya = gd._fullLayout.yaxis;
        const i = Math.floor(t.x.length / 2), box = gd.querySelector('.main-svg').getBoundingClientRect();
        const p = (ax, v) => ax.type === 'category' ? ax.d2p(v) : ax.c2p(v);
        return [box.left + xa._offset + p(xa, t.x[i]), box.top + ya._offset + p(ya, t.y[i])];
    }""", chart_id)
    page.mouse.move(x, y)
    page.wait_for_selector(f"#{chart_id} .hoverlayer .hovertext", timeout=5000)
    return page.text_content(f"#{chart_id} .hoverlayer")


def test_report_page_offline_headline_and_hover(browser, tmp_path):
    with FakeServer(script) as srv:
        assert run_cli(["single", "--url", srv.url, "-n", "12", "--warmup", "0", "--out", str(tmp_path),
                        "--price", "deepseek-v4-flash", "--no-progress"]) == 0
    report = json.load(open(next(tmp_path.glob("single-*.json"))))
    page, problems, requests = open_page(browser, next(tmp_path.glob("single-*.html")))
    assert problems == [] and requests == []
    ttft = report["groups"][0]["metrics"]["ttft_s"]
    card = page.inner_text("[data-key='ttft_s']")
    assert f"{ttft['mean'] * 1e3:.1f} ms" in card and f"{ttft['ci_low'] * 1e3:.1f}" in card
    cost = report["cost"]["tokens"]["per_request"]["mean"]
    assert f"{cost:.6f}" in page.inner_text("[data-key='cost_per_request']")
    assert "cold" in page.inner_text("[data-key='cache']")
    assert page.locator(".js-plotly-plot").count() >= 3
    label = hover_first_point(page, "chart0")  # the TTFT CDF: "<x> ms: <y>%"
    assert " ms: " in label and "%" in label


def test_replay_page_has_session_timelines(browser, tmp_path):
    from sudu.bench.trace import synthetic_sessions, write_jsonl

    trace = tmp_path / "t.jsonl"
    write_jsonl(synthetic_sessions(sessions=3, turns=3, teams=1, block_size=16, tool_wait_s=0.1), str(trace))
    with FakeServer(PrefixCache()) as srv:
        assert run_cli(["replay", str(trace), "--url", srv.url, "--speedup", "5", "--out", str(tmp_path),
                        "--no-progress", "--chunk-usage", "off"]) == 0
    page, problems, requests = open_page(browser, next(tmp_path.glob("replay-*.html")))
    assert problems == [] and requests == []
    ids = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].map(g => g.layout.title.text || '')")
    timeline = next(i for i, t in enumerate(ids) if "per-session timeline" in t)
    sessions = page.evaluate(f"() => document.getElementById('chart{timeline}')._fullData[0].y")
    assert sorted(set(sessions)) == ["s0", "s1", "s2"]
    rp = json.load(open(next(tmp_path.glob("replay-*.json"))))["replay"]
    card = page.inner_text("[data-key='replay_hit']")
    assert f"{100 * rp['reached_hit_rate']:.1f}%" in card and f"ideal {100 * rp['ideal_hit_rate']:.1f}%" in card


def test_compare_page_shows_ratios_and_verdicts(browser, tmp_path):
    from sudu.bench.fake_server import chat_script as cs

    def slow(body):
        return cs([(0.02 + 0.001 * i, f" w{i}") for i in range(6)],
                  usage={"prompt_tokens": 50, "completion_tokens": 6, "total_tokens": 56})

    paths = []
    for k, fn in enumerate((script, slow)):
        out = tmp_path / f"run{k}"
        with FakeServer(fn) as srv:
            run_cli(["single", "--url", srv.url, "-n", "12", "--warmup", "0", "--out", str(out), "--no-html",
                     "--no-progress", "--prompt", "hi"])
        paths.append(str(next(out.glob("single-*.json"))))
    html_path = tmp_path / "ab.html"
    assert run_cli(["compare", *paths, "--html", str(html_path)]) == 0
    page, problems, requests = open_page(browser, html_path)
    assert problems == [] and requests == []
    rows = page.inner_text("table")
    assert "ttft_s" in rows and "B worse" in rows  # B's first token came 16 ms later, every time
    label = hover_first_point(page, "chart0")
    assert "(" in label and ")" in label
