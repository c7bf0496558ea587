"""The studio (`/ui`, docs/studio.md) in a real browser: the system chromium driven by Playwright against the
shared real server (tests/conftest.py), through the page's own controls.

- sample N streamed answers in the playground, rate them with the page's buttons, turn continual training on
  in the Models tab and watch it serve step 1, then roll back to step 0 and forward again;
- the dashboard's reward chart draws exactly the history's reward means; the token view has one span per
  output token (a screenshot is kept in $ARTLIKE_TEST_ARTIFACTS, else the test's tmp dir);
- prompts, outputs and comments holding HTML and script are shown as text and never run.

Sync Playwright in plain `def` tests (it refuses to run inside a running asyncio loop). Needs `playwright` in
the venv and a system `chromium` (`make setup` installs both); never `playwright install`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from artlike_server.launcher import ServerProcess

from .helpers import http_client, openai_client

pytestmark = pytest.mark.integration

XSS = "<script>window.__xss=1</script><img src=x onerror=window.__xss=2>"
STEP_TIMEOUT_MS = 90_000


# ----------------------------------------------------------------------------------------------- browser


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("STUDIO BROWSER TESTS SKIPPED: the `playwright` package is not installed in this venv "
                    "(`.venv/bin/python -m pip install playwright`; `make setup` does it)")
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    if executable is None:
        pytest.skip("STUDIO BROWSER TESTS SKIPPED: no system `chromium` on PATH (`apt-get install -y chromium`; "
                    "`make setup` does it). Playwright's own browser download is never used.")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=["--no-sandbox"], headless=True)
        try:
            yield launched
        finally:
            launched.close()


class Studio:
    """One logged-in page, plus what the browser reported (uncaught exceptions, CSP violations)."""

    def __init__(self, browser: Any, server: ServerProcess) -> None:
        self.server = server
        self.context = browser.new_context(viewport={"width": 1280, "height": 800})
        self.page = self.context.new_page()
        self.page.set_default_timeout(30_000)
        self.problems: list[str] = []
        self.page.on("pageerror", lambda error: self.problems.append(f"page error: {error}"))
        self.page.on("console", self._console)
        self.rating_posts: list[str] = []  # what the page sent to POST /v1/ratings (for failure messages)
        self.page.on("request", lambda r: self.rating_posts.append(r.post_data or "")
                     if r.method == "POST" and r.url.endswith("/v1/ratings") else None)

    def _console(self, message: Any) -> None:
        if message.type == "error" and "Content Security Policy" in message.text:
            self.problems.append(f"CSP violation: {message.text}")

    def login(self) -> Studio:
        page = self.page
        page.goto(f"{self.server.base_url}/ui")
        page.wait_for_selector("#login:not([hidden])")
        page.fill("#login-key", "not-the-key")
        page.click("#login-submit")
        page.wait_for_selector("#login-error:not([hidden])")
        assert "Invalid API key" in page.inner_text("#login-error")
        page.fill("#login-key", self.server.api_key)
        page.click("#login-submit")
        page.wait_for_selector("#tab-playground:not([hidden])")
        assert page.is_hidden("#login")
        return self

    def tab(self, name: str) -> None:
        self.page.click(f"#tabs [data-tab='{name}']")
        self.page.wait_for_selector(f"#tab-{name}:not([hidden])")

    def sample(self, model: str, user: str, *, n: int, max_tokens: int, system: str = "") -> list[dict[str, Any]]:
        """Sample n answers in the playground; wait until every card streamed and knows its completion id."""
        page = self.page
        self.tab("playground")
        page.click("#pg-refresh-models")
        page.wait_for_selector(f'#pg-model option[value="{model}"]', state="attached")
        page.select_option("#pg-model", model)
        page.fill("#pg-system", system)
        page.fill("#pg-turns .turn-content >> nth=0", user)
        page.fill("#pg-n", str(n))
        page.fill("#pg-temperature", "1.0")
        page.fill("#pg-max-tokens", str(max_tokens))
        page.click("#pg-sample")
        page.wait_for_function(
            """n => { const cards = [...document.querySelectorAll('#pg-cards .card')];
                      return cards.length === n && cards.every(c => ['done', 'error'].includes(c.dataset.state)); }""",
            arg=n, timeout=STEP_TIMEOUT_MS)
        cards = page.eval_on_selector_all("#pg-cards .card", """cards => cards.map(c => ({
            state: c.dataset.state, id: Number(c.dataset.completionId), trajectory_id: c.dataset.trajectoryId,
            text: c.querySelector('.card-text').textContent }))""")
        assert [c["state"] for c in cards] == ["done"] * n, (cards, page.inner_text("#status"))
        assert all(c["trajectory_id"].startswith("studio-") for c in cards)
        assert len({c["id"] for c in cards}) == n
        return cards

    def select_model(self, name: str) -> None:
        self.tab("models")
        self.page.wait_for_selector(f'#models-model option[value="{name}"]', state="attached")
        if self.page.input_value("#models-model") != name:
            self.page.select_option("#models-model", name)
        # The panels show this model (not the one shown before): both carry its name once drawn for it.
        self.page.wait_for_selector(f'#models-live[data-model="{name}"]', state="attached")
        self.page.wait_for_selector(f'#ct-message[data-model="{name}"]', state="attached")

    def refresh_inbox(self) -> None:
        """Reload the inbox list through the page's own filter form (focus stays where it is, as when a load
        started by a tab switch or a filter change lands while the user types) and wait until it is drawn."""
        self.page.evaluate("() => document.querySelector('#inbox-filters').requestSubmit()")
        self.wait_inbox_drawn()

    def wait_inbox_drawn(self) -> None:
        """Wait until the newest inbox load started so far is drawn. Each load marks the list 'loading' as it
        starts (synchronously, inside the click or submit that starts it), the newest one 'ready' once drawn."""
        self.page.wait_for_selector("#inbox-list[data-state='ready']", state="attached")

    def live_step(self) -> int:
        return int(self.page.get_attribute("#models-live", "data-live-step") or -1)

    def wait_live_step(self, step: int, timeout: int = 30_000) -> None:
        self.page.wait_for_selector(f"#models-live[data-live-step='{step}']", timeout=timeout)

    def close(self) -> None:
        assert not self.problems, self.problems
        self.context.close()


@pytest.fixture
def studio(browser: Any, server: ServerProcess) -> Iterator[Studio]:
    opened = Studio(browser, server)
    try:
        yield opened.login()
    finally:
        opened.close()


# ----------------------------------------------------------------------------------------------- HTTP


def register(server: ServerProcess, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    with http_client(server) as client:
        reply = client.post("/v1/trainable_models", json={"name": name, "base_model": server.model_id,
                                                          "lora": {"rank": 8}})
    assert reply.status_code in (200, 201), reply.text
    return name


def latest_step(server: ServerProcess, name: str) -> int:
    with http_client(server) as client:
        reply = client.get(f"/v1/trainable_models/{name}")
    assert reply.status_code == 200, reply.text
    return int(reply.json()["latest_step"])


def artifacts_dir(tmp_path: Path) -> Path:
    path = Path(os.environ.get("ARTLIKE_TEST_ARTIFACTS") or tmp_path)
    path.mkdir(parents=True, exist_ok=True)
    return path


# ------------------------------------------------------------------------ a) rate, train, roll back


def test_playground_ratings_train_a_step_and_the_alias_rolls_back_and_forth(studio: Studio, server: ServerProcess,
                                                                            tmp_path: Path) -> None:
    name = register(server, "studio-ui")
    page = studio.page
    cards = studio.sample(name, "Write a one-line greeting for a friend.", n=4, max_tokens=48)
    # Every card finished streaming, and the cards show the text; one sampled answer may be empty (the
    # model can end at once), so not every card has to.
    assert all(card["state"] == "done" for card in cards) and any(card["text"].strip() for card in cards), cards

    # two thumbs up, two thumbs down, with the page's buttons
    card = page.locator("#pg-cards .card")
    for index, action in enumerate(["up", "up", "down", "down"]):
        card.nth(index).locator(f"button[data-action='{action}']").click()
        page.wait_for_selector(f"#pg-cards .card[data-index='{index}'][data-rated='{action}']")
    assert "rated" in card.nth(0).locator(".badge").inner_text()
    page.screenshot(path=str(artifacts_dir(tmp_path) / "studio-playground.png"))
    with http_client(server) as client:
        ratings = client.get("/v1/ratings", params={"model": name}).json()["data"]
    assert len(ratings) == 4, ratings
    assert {r["completion_id"]: r["value"] for r in ratings} == {
        c["id"]: v for c, v in zip(cards, ["up", "up", "down", "down"], strict=True)}
    assert all(r["kind"] == "thumb" and r["step"] == 0 for r in ratings)

    # continual training on, K = 4, with the Models tab's controls: the 4 pending ratings are due at once
    studio.select_model(name)
    assert studio.live_step() == 0
    page.wait_for_selector("#ct-state[data-state='off']")
    page.fill("#ct-every", "4")
    with page.expect_response(lambda r: r.url.endswith(f"/{name}/continual") and r.request.method == "PATCH") as reply:
        page.check("#ct-enabled")
    assert reply.value.ok, reply.value.text()
    status = reply.value.json()
    assert status["policy"]["enabled"] is True and status["policy"]["every"] == 4, status

    studio.wait_live_step(1, timeout=STEP_TIMEOUT_MS)
    assert latest_step(server, name) == 1
    page.wait_for_selector("#steps-table tr[data-step='1'].live")
    page.wait_for_selector("#ct-events li")  # the run's /_train_model events
    page.wait_for_function("() => document.querySelector('#ct-message').textContent.startsWith('step 1 live')")
    page.wait_for_selector("#ratings-list .chip-ok")  # "trained in step 1"
    assert "trained in step 1" in page.inner_text("#ratings-list")
    page.screenshot(path=str(artifacts_dir(tmp_path) / "studio-continual.png"), full_page=True)

    # roll back to step 0, then forward to step 1, with "Serve this step"
    page.click("#steps-table tr[data-step='0'] button.serve")
    studio.wait_live_step(0)
    assert latest_step(server, name) == 0
    page.wait_for_selector("#steps-table tr[data-step='0'].live")
    page.click("#steps-table tr[data-step='1'] button.serve")
    studio.wait_live_step(1)
    assert latest_step(server, name) == 1
    assert page.is_hidden("#status") or "error" not in (page.get_attribute("#status", "class") or "")


# --------------------------------------------------------------------------- b) dashboard and tokens


def rollout(server: ServerProcess, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    trajectory_id = f"dash-{uuid.uuid4().hex}"
    with openai_client(server, trajectory_id, timeout=300) as client:
        completion = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=1.0)
    assert completion.usage is not None
    return {"trajectory_id": trajectory_id, "completion_tokens": completion.usage.completion_tokens,
            "finish_reason": completion.choices[0].finish_reason}


def train_step(server: ServerProcess, model: str, rewards: list[float], **config: Any) -> list[dict[str, Any]]:
    """One GRPO step on fresh rollouts with the given (varied) rewards; returns the rollouts."""
    with ThreadPoolExecutor(max_workers=len(rewards)) as pool:
        rollouts = list(pool.map(lambda _: rollout(server, model, "Name a colour.", 8), rewards))
    group = [{"trajectory_id": r["trajectory_id"], "reward": reward} for r, reward in zip(rollouts, rewards, strict=True)]
    body = {"model": model, "groups": [{"trajectories": group}], "config": {"learning_rate": 1e-4, **config}}
    with http_client(server) as client, client.stream("POST", "/_train_model", json=body) as reply:
        assert reply.status_code == 200, reply.read()
        events = [json.loads(line) for line in reply.iter_lines() if line]
    done = [e for e in events if e.get("type") == "done"]
    assert done and done[0]["trained"], events
    return rollouts


def test_dashboard_charts_history_and_the_token_view(studio: Studio, server: ServerProcess, tmp_path: Path) -> None:
    name = register(server, "studio-dash")
    train_step(server, name, [0.0, 0.5, 1.0, 1.0], measure_kl_to_base=True)
    rollouts = train_step(server, name, [0.0, 0.0, 0.25, 1.0], measure_kl_to_base=True)
    with http_client(server) as client:  # a harness's score, recorded as a step evaluation
        evaluation = {"step": 2, "metrics": {"acc": 0.75}, "split": "lm-eval"}
        assert client.post(f"/v1/trainable_models/{name}/evaluations", json=evaluation).status_code == 200
        lines = client.get(f"/v1/trainable_models/{name}/history").json()["data"]
    steps = [line for line in lines if "event" not in line]
    assert [line["step"] for line in steps] == [1, 2], lines
    # the plateau diagnostics: one mixed group per step (pass_threshold 0.5 passes 3 of 4, then 1 of 4), up to
    # 8 sampled tokens each; step 1 trains from the base (its LoRA starts at 0), step 2 from a trained step
    for line, pass_rate in zip(steps, (0.75, 0.25), strict=True):
        assert (line["zero_variance_fraction"], line["groups_all_wrong"], line["groups_mixed"],
                line["groups_all_right"], line["pass_rate"]) == (0.0, 0, 1, 0, pass_rate), line
        assert 0 < line["response_tokens_mean"] <= 8 and line["sampling_entropy"] > 0 and line["entropy"]["mean"] > 0
    assert steps[0]["kl_to_base"]["mean"] == pytest.approx(0.0, abs=1e-7) and steps[1]["kl_to_base"]["mean"] > 0

    page = studio.page
    studio.select_model(name)
    studio.wait_live_step(2)
    page.wait_for_function("() => document.querySelectorAll('svg[data-chart=reward] circle').length === 2")
    drawn = page.eval_on_selector_all("svg[data-chart=reward] circle",
                                      "points => points.map(p => [Number(p.dataset.step), Number(p.dataset.value)])")
    assert [step for step, _ in drawn] == [1, 2]
    for (step, value), line in zip(drawn, steps, strict=True):
        assert step == line["step"] and value == pytest.approx(line["reward"]["mean"], abs=1e-6), (drawn, line)
    for chart in ("loss", "kl", "clip_fraction", "entropy", "tokens_per_s", "groups_skipped", "zero_variance_fraction",
                  "pass_rate", "sampling_entropy", "kl_to_base", "response_tokens", "learning_rate", "entropy_coef"):
        assert page.locator(f"svg[data-chart='{chart}'] circle").count() == 2, chart
    # the settings each step trained with: train_step's learning rate, GRPO's default entropy bonus
    for chart, value in (("learning_rate", 1e-4), ("entropy_coef", 0.0)):
        values = page.eval_on_selector_all(f"svg[data-chart={chart}] circle",
                                           "points => points.map(p => Number(p.dataset.value))")
        assert values == [pytest.approx(value), pytest.approx(value)], (chart, values)
    labels = page.eval_on_selector_all("svg[data-chart=learning_rate] text.tick",
                                       "ticks => ticks.map(t => t.textContent)")
    assert len(labels) == len(set(labels)) > 2, labels  # small values keep the digits that tell ticks apart
    assert page.locator("#steps-table tbody tr").count() == 3  # steps 0, 1, 2
    assert page.inner_text("#steps-table tr[data-step='2'] td.evaluations") == "lm-eval acc 0.75"
    assert page.inner_text("#steps-table tr[data-step='1'] td.evaluations") == "—"
    page.wait_for_timeout(300)  # let the charts settle before the picture
    shot = artifacts_dir(tmp_path) / "studio-dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000

    # the token view of one trained trajectory: one coloured span per output token
    target = rollouts[0]
    with http_client(server) as client:
        view = client.get(f"/v1/trajectories/{target['trajectory_id']}/view").json()
    tokens = view["completions"][0]["tokens"]
    assert len(tokens) == target["completion_tokens"], (len(tokens), target)
    studio.tab("trajectories")
    page.select_option("#traj-model", name)
    page.click("#traj-refresh")
    row = page.locator(f"#traj-table tr[data-trajectory-id='{target['trajectory_id']}']")
    row.click()
    page.wait_for_selector(f"#traj-view[data-trajectory-id='{target['trajectory_id']}'] .tokens")
    spans = page.locator("#traj-view .tokens span.tok")
    assert spans.count() == len(tokens)
    first = tokens[0]
    assert spans.nth(0).get_attribute("title") == f"logprob {first['logprob']:.3f}"
    assert spans.nth(0).text_content() == first["text"]
    assert spans.nth(0).evaluate("s => s.style.backgroundColor") != ""
    page.screenshot(path=str(artifacts_dir(tmp_path) / "studio-trajectory.png"))

    # the jobs tab lists managed jobs (or says there is none) without an error
    studio.tab("jobs")
    page.wait_for_selector("#jobs-table tbody tr, #jobs-empty:not([hidden])")
    assert page.is_hidden("#status") or "error" not in (page.get_attribute("#status", "class") or "")


# ------------------------------------------------------------------------------------------- c) XSS


def assert_no_injection(page: Any) -> None:
    assert page.evaluate("() => window.__xss") is None
    assert page.evaluate("() => document.querySelectorAll('img').length") == 0
    assert page.evaluate("() => [...document.scripts].every(s => s.src.endsWith('/ui/static/app.js'))")


def test_markup_in_prompts_outputs_and_comments_is_shown_as_text(studio: Studio, server: ServerProcess) -> None:
    name = register(server, "studio-xss")
    page = studio.page
    cards = studio.sample(name, f"Repeat this: {XSS}", n=2, max_tokens=16, system=XSS)
    rated, unrated = cards
    with http_client(server) as client:
        reply = client.post("/v1/ratings", json={"kind": "thumb", "completion_id": rated["id"], "value": "up",
                                                 "comment": XSS})
    assert reply.status_code == 201, reply.text
    assert_no_injection(page)

    # the inbox: the unrated answer, its prompt shown literally
    studio.tab("inbox")
    page.select_option("#inbox-model", name)
    page.click("#inbox-refresh")
    item = page.locator(f".inbox-item[data-completion-id='{unrated['id']}']")
    item.wait_for()
    assert page.locator(f".inbox-item[data-completion-id='{rated['id']}']").count() == 0  # rated: not in the inbox
    assert XSS in item.inner_text()
    assert_no_injection(page)

    # the trajectory view: the system prompt and the user message, literally
    studio.tab("trajectories")
    page.select_option("#traj-model", name)
    page.click("#traj-refresh")
    page.click(f"#traj-table tr[data-trajectory-id='{rated['trajectory_id']}']")
    page.wait_for_selector(f"#traj-view[data-trajectory-id='{rated['trajectory_id']}'] .completion")
    view_text = page.inner_text("#traj-view")
    assert XSS in view_text and "<script>" in view_text
    assert_no_injection(page)

    # the comment, in the Models tab's ratings
    studio.select_model(name)
    comment = page.locator("#ratings-list .rating-comment")
    comment.first.wait_for()
    assert comment.first.inner_text() == XSS
    assert_no_injection(page)

    # rating from the inbox removes the item (and the page's rating carries the comment as text too)
    studio.tab("inbox")
    page.select_option("#inbox-model", name)
    page.click("#inbox-refresh")
    # The tab's own load, the filter change's and the refresh's: the newest is drawn. (A wait for "networkidle"
    # returned at once here: that load state was reached long before; fill() then raced the redraw.)
    studio.wait_inbox_drawn()
    item = page.locator(f".inbox-item[data-completion-id='{unrated['id']}']")
    item.locator("input.comment").fill(XSS)
    item.locator("button[data-action='scale-4']").click()
    item.wait_for(state="detached")
    with http_client(server) as client:
        ratings = {r["completion_id"]: r for r in client.get("/v1/ratings", params={"model": name}).json()["data"]}
    assert ratings[unrated["id"]]["kind"] == "scale" and ratings[unrated["id"]]["value"] == 4
    assert ratings[unrated["id"]]["comment"] == XSS and ratings[unrated["id"]]["rater"] == "studio", \
        studio.rating_posts
    assert_no_injection(page)


def test_a_comment_being_typed_in_the_inbox_survives_redraws(studio: Studio, server: ServerProcess) -> None:
    """A load of the inbox (tab switch, filter change, Refresh) that lands while a comment is being typed keeps
    the text, the focus and the caret; an item that leaves the list and comes back gets its draft back; the
    rating sends the whole comment. (Playwright's fill() focuses the box, then inserts the text into whatever
    has the focus: a redraw in between once sent a rating without its comment.)"""
    name = register(server, "studio-draft")
    page = studio.page
    (card,) = studio.sample(name, "Say hi.", n=1, max_tokens=4)
    studio.tab("inbox")
    page.select_option("#inbox-model", name)
    page.click("#inbox-refresh")
    studio.wait_inbox_drawn()
    item = page.locator(f".inbox-item[data-completion-id='{card['id']}']")
    box = item.locator("input.comment")
    box.click()
    page.keyboard.type("first half")

    studio.refresh_inbox()  # the list is redrawn while the box has the focus
    assert box.evaluate("b => b === document.activeElement"), \
        page.evaluate("() => document.activeElement && document.activeElement.outerHTML.slice(0, 120)")
    assert box.evaluate("b => [b.selectionStart, b.selectionEnd]") == [10, 10]
    page.keyboard.insert_text(", second half")  # what fill() does once it focused the box
    assert box.input_value() == "first half, second half"

    # the item leaves the list (a filter no item matches), then comes back as a new element: the draft is kept
    page.fill("#inbox-step", "999999")
    studio.refresh_inbox()
    item.wait_for(state="detached")
    page.fill("#inbox-step", "")
    studio.refresh_inbox()
    assert box.input_value() == "first half, second half"

    item.locator("button[data-action='scale-4']").click()
    item.wait_for(state="detached")
    with http_client(server) as client:
        ratings = client.get("/v1/ratings", params={"model": name}).json()["data"]
    assert [(r["completion_id"], r["kind"], r["value"], r["comment"]) for r in ratings] == \
        [(card["id"], "scale", 4, "first half, second half")], studio.rating_posts


# ------------------------------------------------------------------------- d) best of N and keyboard


def test_best_of_n_ranking_and_keyboard_rating(studio: Studio, server: ServerProcess) -> None:
    page = studio.page
    cards = studio.sample(server.model_id, "Name an animal.", n=3, max_tokens=8)
    page.check("#pg-rank-mode")
    page.click("#pg-cards .card[data-index='2'] .card-text")  # best
    page.click("#pg-cards .card[data-index='0'] .card-text")  # then this one
    assert page.eval_on_selector_all("#pg-cards .rank-input", "inputs => inputs.map(i => i.value)") == ["2", "", "1"]
    assert page.is_enabled("#pg-send-ranking")
    page.keyboard.press("Enter")  # focus is on a card, not in an input: Enter sends the ranking
    page.wait_for_selector("#pg-cards .card[data-index='2'][data-rated='rank-1']")
    page.wait_for_selector("#pg-cards .card[data-index='0'][data-rated='rank-2']")

    page.keyboard.press("k")  # to the first card, then one down: the unranked card
    page.keyboard.press("j")
    assert page.evaluate("() => document.activeElement.dataset.index") == "1"
    page.keyboard.press("4")
    page.wait_for_selector("#pg-cards .card[data-index='1'][data-rated='scale-4']")

    with http_client(server) as client:
        data = client.get("/v1/ratings", params={"model": server.model_id, "limit": 1000}).json()["data"]
    mine = {r["completion_id"]: r for r in data if r["completion_id"] in {c["id"] for c in cards}}
    best, second, scaled = mine[cards[2]["id"]], mine[cards[0]["id"]], mine[cards[1]["id"]]
    assert best["kind"] == second["kind"] == "ranking" and best["ranking_id"] == second["ranking_id"]
    assert (best["reward"], second["reward"]) == (1.0, 0.0)
    assert scaled["kind"] == "scale" and scaled["value"] == 4 and scaled["reward"] == pytest.approx(0.75)
