"""What the chart's dashboards and alerts ask Prometheus, and which metric names that needs: the shared half of the
dashboard, alert and end-to-end Prometheus tests. No PromQL parser runs here, so names are found lexically
(strings, label matchers, grouping clauses and ranges removed, then every identifier that is not a keyword or a
function call); `promtool check rules` over the same expressions checks that they parse."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "kvmesh"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
RULES = CHART / "alerts" / "kvmesh.rules.yaml"

# What a dashboard's variables stand for when a test runs its queries: every namespace and pool, a rate window
# that spans several scrapes, the engines' default forecast horizon, and the device tier.
VARIABLES = {"$namespace": ".*", "$pool": ".*", "$__rate_interval": "1m", "$horizon": "10s", "$tier": "device"}

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
            "bool", "inf", "nan", "le", "atan2"}


@dataclass(frozen=True)
class Query:
    """One PromQL expression and where it lives, for messages that say which panel or alert is wrong."""

    where: str
    expr: str

    @property
    def concrete(self) -> str:
        """The expression as Prometheus runs it once Grafana has filled in the variables."""
        expr = self.expr
        for name, value in VARIABLES.items():
            expr = expr.replace(name, value)
        assert "$" not in expr, f"{self.where}: unknown variable in {expr!r}"
        return expr


def dashboard(path: Path) -> dict:
    return json.loads(path.read_text())


def panels(board: dict) -> Iterable[dict]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(path: Path) -> list[Query]:
    """Every panel target's expression of one dashboard file."""
    board = dashboard(path)
    return [Query(f"{path.name}: {panel['title']} [{target['refId']}]", target["expr"])
            for panel in panels(board) for target in panel.get("targets", [])]


def variable_queries(path: Path) -> list[Query]:
    """The `label_values(SELECTOR, label)` of the dashboard's query variables, as the selector alone."""
    found = []
    for var in dashboard(path)["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
            assert m, f"{path.name}: variable {var['name']} is not label_values(selector, label)"
            found.append(Query(f"{path.name}: variable {var['name']}", m.group(1)))
    return found


def alert_queries(path: Path = RULES) -> list[Query]:
    groups = yaml.safe_load(path.read_text())["groups"]
    return [Query(f"{path.name}: {rule.get('alert') or rule['record']}", rule["expr"])
            for group in groups for rule in group["rules"]]


def all_queries() -> list[Query]:
    return [q for path in DASHBOARDS for q in dashboard_queries(path) + variable_queries(path)] + alert_queries()


def metric_names(expr: str) -> set[str]:
    """The metric names an expression reads (series names, colons included)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    text = re.sub(r"\boffset\s+\S+", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in KEYWORDS:
            continue
        names.add(name)
    return names


def exported_names(exposition: str) -> set[str]:
    """The series names a /metrics text offers, from its TYPE lines (a counter or histogram with no samples yet
    still offers its _total, or _bucket, _sum and _count)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                        "summary": ("", "_sum", "_count", "_created")}.get(kind, ("",))
            names |= {name.removesuffix("_total") + s if kind == "counter" else name + s for s in suffixes}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def promtool() -> str:
    """promtool's path; the Makefile's `prometheus` target installs Debian's package."""
    path = shutil.which("promtool")
    assert path, "promtool not found: run `make prometheus` (apt-get install prometheus)"
    return path


def check_metrics(exposition: str) -> list[str]:
    """`promtool check metrics` findings, minus the colon complaints that vLLM's compatibility names must raise
    (docs/contracts.md, contract 3 keeps their colons)."""
    out = subprocess.run([promtool(), "check", "metrics"], input=exposition, capture_output=True, text=True)
    findings = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    return [f for f in findings if not (f.startswith("vllm:") and "should not contain ':'" in f)]
