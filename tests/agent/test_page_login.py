"""Signing in to the agent's page over TCP: the form, the session cookie and what it opens.

Against the page's own routes served by a real uvicorn on 127.0.0.1 (with a clock the test moves, to end
a session) and against a real ``torpor agent --listen``, in httpx (the cookie's flags as the header sets
them) and in Debian's chromium (the form typed into, the cookie as the browser keeps it). Once signed in,
the real agent's page shows its jobs, the scheduler's queue and budget, and each job's memory chart.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from conftest import Torpor, free_port, python_job, serving
from torpor.apps.agent import login, web
from torpor.apps.agent.login import MAX_SESSIONS, SESSION_COOKIE, SESSION_LIFETIME_S, PageLogin, Sessions

from .browsing import RAW_FLOAT, browser, made_up_node, read_page, screenshot, wait_shown
from .conftest import AgentProcess

__all__ = ["browser"]  # the fixture, for pytest
# one browser for the module: make suite runs the browser tests on one worker
pytestmark = pytest.mark.xdist_group("chromium")


SECRET = "a-token-for-the-page-test-0123456789"


def cookie_of(response: httpx.Response) -> dict[str, str]:
    """The attributes of the session cookie ``response`` sets, by lower-case name (flags map to "")."""
    [header] = [h for h in response.headers.get_list("set-cookie") if h.startswith(f"{SESSION_COOKIE}=")]
    first, *attributes = (part.strip() for part in header.split(";"))
    found = {"value": first.partition("=")[2]}
    for attribute in attributes:
        name, _, value = attribute.partition("=")
        found[name.lower()] = value
    return found


def check_sign_in_over_http(url: str) -> str:
    """The form, a wrong token, the right one and what its cookie opens (the page, not the API); the
    session's id."""
    asked = httpx.get(url + "/")
    assert asked.status_code == 401 and 'name="token"' in asked.text and 'action="/login"' in asked.text
    assert "form-action 'self'" in asked.headers["content-security-policy"]
    assert asked.headers["cache-control"] == "no-store"
    assert httpx.get(url + "/v1/jobs").status_code == 401
    started = time.monotonic()
    wrong = httpx.post(url + "/login", data={"token": SECRET[:-1]})
    assert time.monotonic() - started >= login.WRONG_TOKEN_DELAY_S
    assert wrong.status_code == 401 and "That is not the agent&#x27;s token." in wrong.text
    assert "set-cookie" not in wrong.headers
    right = httpx.post(url + "/login", data={"token": SECRET})
    assert right.status_code == 303 and right.headers["location"] == "/"
    cookie = cookie_of(right)
    assert set(cookie) == {"value", "httponly", "samesite", "path", "max-age"}  # not Secure: plain HTTP
    assert cookie["samesite"].lower() == "strict" and cookie["path"] == "/"
    assert int(cookie["max-age"]) == SESSION_LIFETIME_S and len(cookie["value"]) >= 40
    session = {SESSION_COOKIE: cookie["value"]}
    page = httpx.get(url + "/", cookies=session)
    assert page.status_code == 200 and 'action="/logout"' in page.text and "<h2>Jobs</h2>" in page.text
    # the cookie opens the page only: the API asks for the bearer token still, reading or acting
    assert httpx.get(url + "/v1/jobs", cookies=session).status_code == 401
    assert httpx.get(url + "/metrics", cookies=session).status_code == 401
    assert httpx.post(url + "/v1/drain", cookies=session, json={}).status_code == 401
    unknown = httpx.get(url + "/", cookies={SESSION_COOKIE: "x" * 43})
    assert unknown.status_code == 401 and 'name="token"' in unknown.text
    assert httpx.post(url + "/login", content=b"token=" + b"a" * 5000).status_code == 413
    return cookie["value"]


def test_a_session_ends_at_its_time_or_when_signed_out_and_the_form_asks_again() -> None:
    clock = [time.time()]
    sessions = Sessions(lifetime_s=SESSION_LIFETIME_S, clock=lambda: clock[0])
    page_login = PageLogin(SECRET, sessions)
    node, history, _, events = made_up_node(time.time())
    app = FastAPI()
    app.middleware("http")(page_login.middleware())
    page_login.add_routes(app)
    web.add_routes(
        app, lambda: node, lambda: events, dict, 0, history=lambda: history, signed_in=page_login.signed_in
    )
    with serving(app) as url:
        session = check_sign_in_over_http(url)
        clock[0] += SESSION_LIFETIME_S
        expired = httpx.get(url + "/", cookies={SESSION_COOKIE: session})
        assert expired.status_code == 401 and 'name="token"' in expired.text

        # behind a TLS proxy on the same machine (it says so from 127.0.0.1): the cookie is Secure
        proxied = cookie_of(
            httpx.post(url + "/login", data={"token": SECRET}, headers={"X-Forwarded-Proto": "https"})
        )
        assert "secure" in proxied and proxied["samesite"].lower() == "strict"
        second = cookie_of(httpx.post(url + "/login", data={"token": SECRET}))["value"]
        out = httpx.post(url + "/logout", cookies={SESSION_COOKIE: second})
        assert out.status_code == 303 and cookie_of(out)["max-age"] == "0"
        assert httpx.get(url + "/", cookies={SESSION_COOKIE: second}).status_code == 401


def sign_in_with_the_browser(browser: Any, url: str, folder: Path) -> None:
    """The form in the browser: a wrong token says so, the right one opens the page with its cookie."""
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    browser.get(url + "/")
    shown = read_page(browser)
    assert shown["signIn"] and not shown["jobs"] and shown["scripts"] == 0
    screenshot(browser, folder, "sign-in")
    browser.find_element(By.ID, "token").send_keys("not-the-token-at-all")
    browser.find_element(By.CSS_SELECTOR, "form.sign-in button").click()
    shown = wait_shown(browser, lambda page: bool(page["error"]), "the sign-in error")
    assert shown["error"] == "That is not the agent's token." and shown["signIn"]
    screenshot(browser, folder, "sign-in-wrong")
    browser.find_element(By.ID, "token").send_keys(SECRET)
    browser.find_element(By.CSS_SELECTOR, "form.sign-in button").click()
    wait_shown(browser, lambda page: page["signOut"] and bool(page["summary"]), "the page after signing in")
    cookie = browser.get_cookie(SESSION_COOKIE)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
    assert not cookie["secure"] and abs(cookie["expiry"] - (time.time() + SESSION_LIFETIME_S)) < 120
    assert browser.execute_script("return document.cookie") == ""  # HttpOnly: no script could read it


def sign_out_with_the_browser(browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, "form.sign-out button").click()
    wait_shown(browser, lambda page: page["signIn"], "the form after signing out")
    assert browser.get_cookie(SESSION_COOKIE) is None


@pytest.mark.criu
@pytest.mark.timeout(300)
def test_over_tcp_the_agent_asks_for_the_token_once_then_shows_its_jobs_queue_budget_and_charts(
    browser: Any, torpor: Torpor, agent: AgentProcess, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text(SECRET)
    token.chmod(0o600)
    port = free_port()
    sleeper = [sys.executable, "-c", "import time; time.sleep(100000)"]
    torpor.run(
        "run", "--name", "gamma", "--checkpoint-every", "4s", "--budget", "50%", *python_job("counter.py")
    )
    torpor.run("run", "--name", "delta", "--", *sleeper)
    agent.start("--listen", f"127.0.0.1:{port}", "--token-file", str(token), "--memory-budget", "1G")
    url = f"http://127.0.0.1:{port}"
    torpor.run("submit", "--name", "holder", "--memory", "600M", "--", *sleeper)
    torpor.wait_for(
        lambda: {j["name"]: j["state"] for j in torpor.json("queue")["jobs"]}.get("holder") == "running",
        what="the holder to run",
    )
    torpor.run("submit", "--name", "waiter", "--memory", "500M", "--project", "eval", "--", *sleeper)
    agent.wait_event("checkpoint", "gamma", timeout=60)
    time.sleep(11)  # two samples of delta's memory before it sleeps (one each 5 s)
    torpor.run("hibernate", "delta", "--wait")
    check_sign_in_over_http(url)
    sign_in_with_the_browser(browser, url, tmp_path)

    shown = wait_shown(
        browser,
        lambda page: (
            page["charts"].get("gamma", {}).get("points", 0) >= 3
            and len(page["charts"]["gamma"]["marks"]) >= 2
            and any(row["key"] == "waiter" for row in page["queue"])
        ),
        "gamma's memory with its checkpoints, and the waiter in the queue",
        timeout=60,
    )
    jobs = {row["key"]: row["cells"] for row in shown["jobs"]}
    assert (
        jobs["gamma"]["state-cell"] in ("running", "checkpointing")
        and jobs["gamma"]["policy"] == "checkpoint every 4s"
    )
    assert jobs["delta"]["state-cell"].startswith("hibernated")
    assert shown["charts"]["delta"]["marks"][-1][0] == "hibernate" and shown["charts"]["delta"]["points"] >= 2
    assert " · sampled since " in shown["charts"]["gamma"]["caption"]  # an agent started within the hour
    queued = {row["key"]: row["cells"] for row in shown["queue"]}
    assert next(iter(queued)) == "waiter" and queued["waiter"]["state-cell"] == "queued"
    assert queued["waiter"]["request"] == "500.0 MiB" and queued["waiter"]["project"] == "eval"
    assert queued["waiter"]["since"].splitlines()[1].endswith(" ago")
    assert queued["holder"]["state-cell"] == "running" and queued["holder"]["request"] == "600.0 MiB"
    assert shown["budget"].startswith("Memory budget 1.0 GiB: held ")
    assert not RAW_FLOAT.search(shown["body"]), RAW_FLOAT.findall(shown["body"])
    screenshot(browser, tmp_path, "agent-over-tcp")
    sign_out_with_the_browser(browser)

    # Prometheus brings the bearer token, and nothing else is asked of it
    scraped = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {SECRET}"})
    assert scraped.status_code == 200 and 'torpor_jobs{state="hibernated"} 1.0' in scraped.text
    page = httpx.get(url + "/", headers={"Authorization": f"Bearer {SECRET}"})
    assert page.status_code == 200 and 'action="/logout"' not in page.text


def test_a_session_lasts_its_lifetime_and_ends_when_signed_out() -> None:
    clock = [1_800_000_000.0]
    sessions = Sessions(lifetime_s=60, clock=lambda: clock[0])
    first, second = sessions.open(), sessions.open()
    assert first != second and len(first) >= 40
    assert sessions.valid(first) and not sessions.valid("guessed") and not sessions.valid(None)
    sessions.close(second)
    assert not sessions.valid(second)
    clock[0] += 60
    assert not sessions.valid(first)
    many = Sessions(lifetime_s=60, clock=lambda: clock[0])
    opened = [many.open() for _ in range(MAX_SESSIONS + 1)]
    assert not many.valid(opened[0]) and many.valid(opened[-1])  # the oldest goes first
