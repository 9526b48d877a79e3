"""Observability of a running local cluster (Controller, NodeAgent with P and D engines,
Coordinator), all as real processes, under a short disaggregated load:

1. every component's /metrics passes ``promtool check metrics``;
2. a real Prometheus scrapes them all, every dashboard variable resolves and every
   panel's expression returns data;
3. the status page, loaded in headless Chromium, lists the instances and its values
   update while requests flow (a screenshot is saved);
4. with JSON logs, one grep of a request id finds the Coordinator's, P's and D's lines.

One cluster serves the whole module (starting engines is the slow part).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.integration.test_observability_support import (
    INSTANCES,
    PROMETHEUS,
    PROMTOOL,
    SCRAPE_INTERVAL_S,
    LocalCluster,
    Prometheus,
    http_get,
    promtool_problems,
)
from tests.unit.observability.dashboards import (
    label_values_query,
    load_all,
    panels,
    substitute,
    variables,
)

CHROMIUM = shutil.which("chromium")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def workdir():
    path = Path(tempfile.mkdtemp(prefix="pdserve-observability-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster(env={"PDSERVE_LOG_FORMAT": "json"})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def loaded(cluster):
    """The cluster after a first short load: both blocking and streaming completions."""
    cluster.complete(4)
    cluster.complete(2, stream=True)
    return cluster


def test_every_components_metrics_pass_promtool(loaded):
    assert PROMTOOL, "promtool (Debian package prometheus) is not installed: `make test` installs it"
    checked = []
    for component, addresses in loaded.targets.items():
        for address in addresses:
            text = http_get(f"http://{address}/metrics")
            assert f"pdserve_{component}_" in text
            assert promtool_problems(text) == "", f"{component} at {address}"
            checked.append(component)
    assert sorted(checked) == ["controller", "coordinator", "engine", "engine", "nodeagent"]
    engine = http_get(f"http://{loaded.engine_targets['obs-p0']}/metrics")
    moved = re.search(r'pdserve_engine_kv_transfer_bytes_total\{mode="layerwise",role="prefill",'
                      r'transport="tcp"\} (\S+)', engine)
    assert moved and float(moved.group(1)) > 0, "the prefill engine counted the KV it sent"


def test_every_dashboard_panel_returns_data(loaded, workdir):
    assert PROMETHEUS, "prometheus (Debian package prometheus) is not installed: `make test` installs it"
    (workdir / "prometheus").mkdir()
    prom = Prometheus(workdir / "prometheus", {**loaded.targets, **loaded.pool_targets})
    try:
        prom.wait_targets_up()
        loaded.complete(6)  # observations inside the rate windows, scraped at least twice
        time.sleep(3 * SCRAPE_INTERVAL_S + 0.5)
        empty, num_queries = [], 0
        for name, board in load_all().items():
            values = resolve_variables(prom, board)
            for panel in panels(board):
                for target in panel["targets"]:
                    expr = substitute(target["expr"], values)
                    num_queries += 1
                    if not prom.query(expr):
                        empty.append(f"{name} / {panel['title']} / {target['refId']}: {expr}")
        print(f"{num_queries} panel queries answered by Prometheus at {prom.url}")
        assert not empty, "panels without data:\n" + "\n".join(empty)
    finally:
        prom.stop()


def resolve_variables(prom: Prometheus, board: dict) -> dict[str, str]:
    """Each query variable's values from Prometheus (they must exist); the value used in
    panels is the regex of all of them, as Grafana's "All" would give."""
    values: dict[str, str] = {}
    for var in variables(board):
        if var["type"] == "datasource":
            continue
        selector, label = label_values_query(var)
        found = prom.api(f"label/{label}/values", **{"match[]": substitute(selector, values)})
        assert found, f"variable {var['name']} has no values ({var['definition']})"
        values[var["name"]] = "|".join(re.escape(v).replace("\\", "\\\\") for v in found)
    return values


def test_status_page_in_a_real_browser(loaded, workdir):
    assert CHROMIUM, "chromium (Debian package chromium) is not installed: `make test` installs it"
    with Browser(workdir / "chromium") as browser:
        page = browser.open(loaded.url + "/")  # redirects to /ui
        page.wait(lambda: page.eval("document.querySelectorAll('#instances tr').length") == 2)
        rows = page.eval("[...document.querySelectorAll('#instances tr')].map("
                         "r => [...r.cells].map(c => c.textContent))")
        assert {(r[0], r[1]) for r in rows} == set(INSTANCES.items())
        assert all(r[2] == "ready" for r in rows)
        assert page.eval("location.pathname") == "/ui"
        assert page.eval("document.getElementById('mode').textContent") in ("PD", "FALLBACK")
        before = float(page.eval("document.getElementById('total').textContent"))
        loaded.complete(3)
        page.wait(lambda: float(page.eval("document.getElementById('total').textContent")) >= before + 3)
        page.wait(lambda: page.eval("document.getElementById('ttft').textContent").endswith(" ms"))
        page.wait(lambda: page.eval("document.getElementById('kvbw').textContent") != "0 B/s")
        assert "registered" in page.eval("document.getElementById('events').textContent")
        assert page.eval("document.getElementById('error').textContent") == ""
        shot = Path(tempfile.gettempdir()) / f"pdserve-status-page-{os.getpid()}.png"
        shot.write_bytes(page.screenshot())
        print(f"status page screenshot: {shot}")
        assert shot.stat().st_size > 10_000


def test_one_grep_of_a_request_id_finds_coordinator_prefill_and_decode(loaded):
    [rid] = loaded.complete(1)
    deadline = time.monotonic() + 10
    while True:
        lines = [ln for p in loaded.procs for ln in p.lines if rid in ln]
        sources = {"coordinator" if ln in loaded.coordinator_proc.lines else ln.split("]")[0][1:]
                   for ln in lines}
        if {"coordinator", *INSTANCES} <= sources or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {"coordinator", *INSTANCES} <= sources, "\n".join(lines)
    for ln in lines:  # engines log JSON lines (the NodeAgent prefixes them with the instance)
        if not ln.startswith("[obs-"):
            continue
        record = json.loads(ln.split("] ", 1)[1])
        assert rid in record["msg"] and record["level"] in ("INFO", "WARNING")


class Browser:
    """Headless Chromium driven over the DevTools protocol (websockets, no npm)."""

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir()
        self.proc = subprocess.Popen(
            [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={workdir / 'profile'}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
             "--window-size=1280,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        deadline = time.monotonic() + 30
        for line in self.proc.stderr:
            m = re.search(r"DevTools listening on ws://([^/]+)/", line)
            if m:
                self.http = f"http://{m.group(1)}"
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError("chromium exited before it listened")
        self.pages: list[Page] = []

    def __enter__(self) -> Browser:
        return self

    def open(self, url: str) -> Page:
        request = urllib.request.Request(f"{self.http}/json/new?{urllib.parse.quote(url, safe='')}",
                                         method="PUT")
        with urllib.request.urlopen(request, timeout=10) as r:  # noqa: S310 - loopback
            target = json.loads(r.read())
        page = Page(target["webSocketDebuggerUrl"])
        self.pages.append(page)
        return page

    def __exit__(self, *exc) -> None:
        for page in self.pages:
            page.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stderr.close()


class Page:
    def __init__(self, ws_url: str) -> None:
        from websockets.sync.client import connect

        self.ws = connect(ws_url, max_size=64 * 2**20).__enter__()
        self._next_id = 0

    def call(self, method: str, **params) -> dict:
        self._next_id += 1
        self.ws.send(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=30))
            if msg.get("id") == self._next_id:
                assert "error" not in msg, msg
                return msg["result"]

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait(self, predicate, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if predicate():
                    return
            except (AssertionError, TypeError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"page condition not met; body:\n{self.eval('document.body.innerText')}")
            time.sleep(0.2)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        self.ws.close()
