"""The three official SDKs at the newest release the package index serves, each at its own defaults.

`scripts/test` upgrades openai, anthropic and google-genai before the suite runs, so CI meets a change of
an SDK's defaults (google-genai 3.x moved from API version v1beta to v1, and the gateway answered 405) the
day it is published, not when a user does. `test_the_sdks_are_the_newest_release` checks the upgrade
happened; the calls below build each client from the environment alone, the way the README points a
harness at a gateway, so the base path, API version and headers are the SDK's own.

The newest version comes from `pip index versions NAME`: about a second per package, answered from the
index pip is configured with (a mirror too), and it lists only releases this Python can install.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.metadata import version

import anthropic
import openai
import pytest
from google import genai
from packaging.version import Version

from tests.conftest import SERVED_MODEL, FakeBackend, Gateway
from tests.fakes.fake_vllm import Reply
from tests.sdk_support import Sampler, check_records

SDKS = ("openai", "anthropic", "google-genai")


def newest_release(name: str) -> str | None:
    """The newest version the configured index serves for `name`, or None if it cannot be asked."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        return None
    m = re.search(rf"^{re.escape(name)} \(([^)]+)\)", proc.stdout, re.MULTILINE)
    return m.group(1) if proc.returncode == 0 and m else None


@pytest.mark.parametrize("name", SDKS)
def test_the_sdks_are_the_newest_release(name: str) -> None:
    newest = newest_release(name)
    if newest is None:
        if os.environ.get("CI"):
            pytest.fail(f"the package index did not answer for {name}: CI must test the newest SDKs")
        pytest.skip(f"the package index cannot be reached for {name}")
    installed = version(name)
    assert Version(installed) >= Version(newest), (
        f"{name} {installed} is installed but {newest} is out: "
        f"pip install -U openai anthropic google-genai (scripts/test does)"
    )


@pytest.fixture
def session(gateway: Gateway, monkeypatch: pytest.MonkeyPatch) -> str:
    """A session whose id is every SDK's API key, and the gateway's URL where each SDK reads its base URL."""
    sid = gateway.new_session()
    for var in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "GOOGLE_GENAI_API_VERSION", "GOOGLE_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OPENAI_BASE_URL", f"{gateway.url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", sid)
    monkeypatch.setenv("ANTHROPIC_BASE_URL", gateway.url)
    monkeypatch.setenv("ANTHROPIC_API_KEY", sid)
    monkeypatch.setenv("GOOGLE_GEMINI_BASE_URL", gateway.url)
    monkeypatch.setenv("GEMINI_API_KEY", sid)
    return sid


def test_openai_at_its_defaults(gateway: Gateway, fake_backend: FakeBackend, session: str) -> None:
    Sampler(fake_backend, Reply(content="chat"), Reply(content="responses"))
    c = openai.OpenAI()
    chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "chat"
    assert c.responses.create(model="m", input="hi").output_text == "responses"
    assert [m.id for m in c.models.list()] == [SERVED_MODEL]
    recs = gateway.completions(session)
    assert [r.dialect for r in recs] == ["chat", "responses"] and all(r.trainable for r in recs)


def test_anthropic_at_its_defaults(gateway: Gateway, fake_backend: FakeBackend, session: str) -> None:
    sampler = Sampler(fake_backend, Reply(content="messages"))
    c = anthropic.Anthropic()
    r = c.messages.create(model="claude", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    assert r.content[0].text == "messages"  # type: ignore[union-attr]
    assert (
        c.messages.count_tokens(model="claude", messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
    )
    assert [m.id for m in c.models.list()] == [SERVED_MODEL]
    check_records(gateway, session, sampler, dialect="anthropic", model="claude")


def test_google_genai_at_its_defaults(gateway: Gateway, fake_backend: FakeBackend, session: str) -> None:
    sampler = Sampler(fake_backend, Reply(content="gemini"))
    c = genai.Client()
    assert c.models.generate_content(model="gemini-2.5-pro", contents="hi").text == "gemini"
    assert [m.name for m in c.models.list()] == [f"models/{SERVED_MODEL}"]
    check_records(gateway, session, sampler, dialect="gemini", model="gemini-2.5-pro")
