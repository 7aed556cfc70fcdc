"""The web dashboard in a real browser over a real run: a short `jetrl run` (every part its own
process, the session's nats-server, a SQLite store), a Monitor following its log and serving the
page, and Debian's headless chromium driven by selenium. The page must update while the run
steps, show at the end exactly the store's figures, and render a step's rollouts token by token.
Screenshots of the dashboard and the inspector go to the artifacts directory ($JETRL_ARTIFACTS,
else <repo>/artifacts)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from rich.console import Console

from jetrl.bus.client import Bus
from jetrl.bus.server import EmbeddedServer
from jetrl.consumers.monitor.service import Monitor
from jetrl.consumers.monitor.terminal import render
from jetrl.consumers.monitor.web import serve
from jetrl.deploy.config import load_config
from jetrl.deploy.supervisor import Supervisor
from jetrl.store import queries
from jetrl.store.db import open_store

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# docs/monitoring.md's screenshots come from a longer run of another env:
# JETRL_BROWSER_TEST_STEPS=150 JETRL_BROWSER_TEST_ENV=reverse
STEPS = int(os.environ.get("JETRL_BROWSER_TEST_STEPS", "20"))
ENV = os.environ.get("JETRL_BROWSER_TEST_ENV", "modsum")
T = TypeVar("T")

if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(
        f"the browser test drives Debian's chromium: {CHROMIUM} and {CHROMEDRIVER} are needed "
        "(apt-get install chromium chromium-driver)",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402  (after the skip: selenium is a dev extra)
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

WebDriver = webdriver.Chrome


def artifacts_dir() -> Path:
    out = Path(os.environ.get("JETRL_ARTIFACTS", REPO / "artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture
def driver(tmp_path: Path) -> Iterator[WebDriver]:
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1400,2300",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    try:
        yield d
    finally:
        d.quit()


def attr(d: WebDriver, element_id: str, name: str) -> str:
    return d.find_element(By.ID, element_id).get_attribute(name) or ""


# A MutationObserver that keeps every value the step tile and the reward chart take, in order.
RECORD_SHOWN = """
const shown = (window.jetrlShown = {"tile-step": [], "chart-reward": []});
new MutationObserver((changes) => {
  for (const c of changes) {
    const into = shown[c.target.id];
    const v = c.target.getAttribute(c.attributeName);
    if (into && v) into.push(Number(v));
  }
}).observe(document.body, {subtree: true, attributes: true, attributeFilter: ["data-value", "data-points"]});
"""


def dedupe(values: list[int]) -> list[int]:
    """The values in the order shown, each repeat of the one before dropped."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def wait_for(d: WebDriver, what: Callable[[WebDriver], T], timeout: float, message: str) -> T:
    # The page redraws parts of itself at every push: an element found may be replaced before
    # it is used, and is then looked up again.
    return WebDriverWait(
        d,
        timeout,
        poll_frequency=0.2,
        ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
    ).until(what, message)


def browser_errors(d: WebDriver) -> list[str]:
    return [e["message"] for e in d.get_log("browser") if e.get("level") == "SEVERE"]


async def test_the_dashboard_follows_a_real_run_and_shows_the_stores_figures(
    nats_server: EmbeddedServer, tmp_path: Path, driver: WebDriver
) -> None:
    cfg = load_config(
        REPO / "configs" / "demo.toml",
        [
            "--trainer.max_steps",
            str(STEPS),
            "--trainer.batch_groups",
            "4",
            "--trainer.checkpoint_every",
            "100",
            "--inference.max_batch_tasks",
            "4",
            "--envs.0.group_size",
            "8",
            "--envs.0.name",
            ENV,
            *(() if ENV == "modsum" else ("--envs.0.params", "{}")),  # the demo's are modsum's
            "--monitor.alerts",
            "false",  # the run's own monitor part: one process fewer on a small machine
            "--bus.max_gib",
            "0.25",
            "--bus.payload_max_gib",
            "0.5",
        ],
    )
    run_id = f"web{uuid.uuid4().hex[:8]}"
    sup = Supervisor(cfg, run_id, tmp_path / run_id, nats_url=nats_server.url, quiet=True)
    bus = await Bus.connect(nats_server.url, name="monitor-web-test")
    # The page is up before the run starts (its parts start in a fraction of a second and a
    # short run is over in seconds): the run's stream first, as the supervisor makes it.
    await bus.ensure_run(run_id, cfg.bus.limits())
    stop = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = []
    run: asyncio.Task[int] | None = None
    try:
        monitor = Monitor(run_id, bus=bus)
        urls: list[str] = []
        tasks.append(asyncio.create_task(monitor.run(stop)))
        tasks.append(
            asyncio.create_task(
                # Pushes 10 times a second: a short run's steps still reach the page in several pushes.
                serve(monitor, host="127.0.0.1", port=0, stop=stop, on_ready=urls.append, push_every_s=0.1)
            )
        )
        while not urls:
            await asyncio.sleep(0.05)
        url = urls[0]
        # Selenium blocks: every browser call runs in a thread, the server in this loop.
        await asyncio.to_thread(driver.get, url)
        # While the run steps, the step tile and the charts move on. The page records each value
        # it shows (a poll from here would miss them where a short run outpaces it).
        await asyncio.to_thread(driver.execute_script, RECORD_SHOWN)
        run = asyncio.create_task(sup.run())
        await asyncio.to_thread(
            wait_for, driver, lambda d: attr(d, "run-id", "textContent") == run_id, 30, "no run id shown"
        )
        assert await run == 0
        shown_values = await asyncio.to_thread(driver.execute_script, "return window.jetrlShown")
        seen = dedupe(shown_values["tile-step"])
        charted = dedupe(shown_values["chart-reward"])
        assert len(seen) >= 2 and seen == sorted(seen), f"the step tile did not move on: {seen}"
        assert charted == sorted(charted) and charted[-1] > charted[0], f"the reward chart: {charted}"

        # At the end: what the page shows is the store's.
        store = open_store(sup.db_url)
        try:
            history = queries.step_history(store, run_id)
        finally:
            store.close()
        last = history[-1]
        assert [h.step for h in history] == list(range(STEPS))

        def finished(d: WebDriver) -> bool:
            return (
                attr(d, "run-status", "data-value") == "completed"
                and attr(d, "tile-step", "data-value") == str(last.step)
                and attr(d, "run-mode", "data-state") == "finished"
            )

        await asyncio.to_thread(wait_for, driver, finished, 20, "the page never showed the finished run")
        assert float(await asyncio.to_thread(attr, driver, "tile-reward", "data-value")) == pytest.approx(
            last.reward_mean, rel=1e-12, abs=1e-12
        )
        assert float(await asyncio.to_thread(attr, driver, "tile-loss", "data-value")) == pytest.approx(
            last.metrics["loss"], rel=1e-12, abs=1e-15
        )
        assert await asyncio.to_thread(attr, driver, "run-step", "data-value") == str(last.step)
        shown = await asyncio.to_thread(
            driver.execute_script,
            "return window.jetrlMonitor.state.points.map(p => [p.step, p['reward/mean'], p['trainer/loss']])",
        )
        assert [s for s, _, _ in shown] == [h.step for h in history]
        for (_, reward, loss), h in zip(shown, history, strict=True):
            assert reward == pytest.approx(h.reward_mean, abs=1e-12)
            assert loss == pytest.approx(h.metrics["loss"], rel=1e-12, abs=1e-15)
        assert await asyncio.to_thread(attr, driver, "chart-reward", "data-points") == str(len(history))
        # In one script: the table is redrawn at every push, its rows replaced.
        shown_workers = set(
            await asyncio.to_thread(
                driver.execute_script,
                "return [...document.querySelectorAll('#workers tr[data-worker]')]"
                ".map(r => r.dataset.worker)",
            )
        )
        # Every inference worker of the run, by its heartbeats (the trainer sends none).
        assert shown_workers == {f"inf-{i}" for i in range(cfg.inference.workers)}
        art = artifacts_dir()
        await asyncio.to_thread(driver.save_screenshot, str(art / "monitor-dashboard.png"))

        # The inspector: a click on the reward chart picks a step...
        def click_reward_chart(d: WebDriver) -> bool:
            from selenium.webdriver.common.action_chains import ActionChains

            layer = d.find_element(By.CSS_SELECTOR, "#chart-reward .nsewdrag")
            d.execute_script("arguments[0].scrollIntoView({block: 'center'})", layer)
            ActionChains(d).move_to_element(layer).pause(0.3).click().perform()
            return True

        await asyncio.to_thread(
            wait_for, driver, click_reward_chart, 20, "the reward chart could not be clicked"
        )
        picked = await asyncio.to_thread(
            wait_for,
            driver,
            lambda d: attr(d, "inspector", "data-state") == "loaded" and attr(d, "inspector", "data-step"),
            20,
            "a click on the reward chart opened no step",
        )
        assert 0 <= int(picked) <= last.step

        # ... and so does the step input; the completion is drawn token by token.
        step = last.step - 1

        def pick(d: WebDriver) -> None:
            box = d.find_element(By.ID, "step-input")
            box.clear()
            box.send_keys(str(step))
            d.find_element(By.ID, "step-go").click()

        await asyncio.to_thread(pick, driver)
        await asyncio.to_thread(
            wait_for,
            driver,
            lambda d: (
                attr(d, "inspector", "data-state") == "loaded"
                and attr(d, "inspector", "data-step") == str(step)
                and int(attr(d, "tokens", "data-count") or 0) > 0
            ),
            30,
            f"step {step}'s tokens were not shown",
        )
        want = await monitor.inspect(step)
        assert want is not None and want["recorded"], "the trainer recorded no token log-probs"
        first = want["rollouts"][0]
        rows = await asyncio.to_thread(
            driver.find_elements, By.CSS_SELECTOR, "#rollout-list tbody tr.rollout"
        )
        assert len(rows) == len(want["rollouts"]) == last.num_rollouts
        tokens = await asyncio.to_thread(
            driver.execute_script,
            "return [...document.querySelectorAll('#tokens .token')].map(t => "
            "[t.dataset.gap, t.dataset.routeDiff, t.className, t.title, t.style.backgroundColor])",
        )
        assert len(tokens) == len(first["tokens"])
        for (gap, route_diff, cls, title, bg), tok in zip(tokens, first["tokens"], strict=True):
            if tok["gap"] is None:
                assert gap == ""
            else:
                assert float(gap) == pytest.approx(tok["gap"]) and bg, "a model token without its colour"
            assert ("routed" in cls.split()) == bool(tok["route_diff"])
            assert route_diff == ("" if tok["route_diff"] is None else str(tok["route_diff"]))
            assert ("env" in cls.split()) == (not tok["model"])
            assert "inference log-prob" in title and "trainer log-prob" in title
        assert any(t["gap"] is not None for t in first["tokens"])
        legend = await asyncio.to_thread(attr, driver, "gap-legend", "textContent")
        assert "trainer log-prob" in legend

        def shoot_inspector(d: WebDriver) -> None:
            box = d.find_element(By.ID, "inspector")
            d.execute_script("arguments[0].scrollIntoView()", box)
            d.find_element(By.CSS_SELECTOR, "#tokens .token").click()  # the mouse off the list
            box.screenshot(str(art / "monitor-inspector.png"))

        await asyncio.to_thread(shoot_inspector, driver)
        errors = await asyncio.to_thread(browser_errors, driver)
        assert not errors, errors

        # The terminal dashboard's frame of the same monitor shows the same figures; its
        # screenshot is the frame as SVG, rendered by the same browser.
        console = Console(record=True, width=150, file=io.StringIO())
        console.print(render(monitor))
        text = console.export_text(clear=False)
        assert f"step {last.step}  version v{last.policy_version}" in text
        assert f"{last.reward_mean:.3f}" in text and f"{last.metrics['loss']:.4f}" in text
        frame = art / "monitor-terminal.svg"
        console.save_svg(str(frame), title=f"jetrl monitor {run_id}")

        def shoot_terminal(d: WebDriver) -> None:
            d.get(frame.resolve().as_uri())
            d.find_element(By.TAG_NAME, "svg").screenshot(str(art / "monitor-terminal.png"))

        await asyncio.to_thread(shoot_terminal, driver)
    finally:
        stop.set()
        if run is not None and not run.done():
            run.cancel()
        for t in [*([run] if run is not None else []), *tasks]:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(t, 30)
        await bus.close()
