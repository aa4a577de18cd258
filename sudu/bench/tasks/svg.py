"""SVG task: a well-formed SVG document (XML-parsed) of 200x200 with a red circle at (100,100) r=50,
a blue rectangle and a text element reading "sudu"."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from sudu.bench.tasks import CheckResult, TaskInstance, extract_code, strip_reasoning

PROMPT = (
    "Write a complete SVG image, 200 by 200 pixels (width=\"200\" height=\"200\"), containing: a red circle "
    "centred at (100, 100) with radius 50, a blue rectangle anywhere, and a text element that reads sudu. "
    "Reply with the SVG in one ```svg code block."
)

RED = {"red", "#f00", "#ff0000", "rgb(255,0,0)"}
BLUE = {"blue", "#00f", "#0000ff", "rgb(0,0,255)"}
_SVG = re.compile(r"<svg\b.*</svg>", re.DOTALL | re.IGNORECASE)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _fill(el: ET.Element) -> str:
    fill = el.get("fill", "")
    m = re.search(r"fill\s*:\s*([^;]+)", el.get("style", ""))
    if m:
        fill = m.group(1)
    return fill.replace(" ", "").lower()


def _num(el: ET.Element, name: str) -> float | None:
    try:
        return float(re.sub(r"px$", "", el.get(name, "").strip()))
    except ValueError:
        return None


def check(answer: str) -> CheckResult:
    code = extract_code(answer, ("svg", "xml", "html"))
    m = _SVG.search(code) or _SVG.search(strip_reasoning(answer))
    if not m:
        return CheckResult(False, "no <svg> element in the answer")
    try:
        root = ET.fromstring(m.group(0))
    except ET.ParseError as exc:
        return CheckResult(False, f"not well-formed XML: {exc}")
    if _local(root.tag) != "svg":
        return CheckResult(False, f"root element is <{_local(root.tag)}>, not <svg>")
    size_ok = (_num(root, "width"), _num(root, "height")) == (200.0, 200.0)
    view = root.get("viewBox", "").replace(",", " ").split()
    if not size_ok and view != ["0", "0", "200", "200"]:
        return CheckResult(False, "the image is not 200x200")
    elements = list(root.iter())
    circles = [e for e in elements if _local(e.tag) == "circle"]
    if not any(
        _fill(c) in RED and (_num(c, "cx"), _num(c, "cy"), _num(c, "r")) == (100.0, 100.0, 50.0) for c in circles
    ):
        return CheckResult(False, "no red circle at (100,100) with r=50")
    if not any(_local(e.tag) == "rect" and _fill(e) in BLUE for e in elements):
        return CheckResult(False, "no blue rectangle")
    if not any(_local(e.tag) == "text" and "sudu" in "".join(e.itertext()).lower() for e in elements):
        return CheckResult(False, "no text element reading sudu")
    return CheckResult(True, "well-formed, all required elements")


def build() -> TaskInstance:
    return TaskInstance(name="svg", messages=[{"role": "user", "content": PROMPT}], check=check, max_tokens=768)
