"""soakd.redact: no secret from a URL or a config dump survives, whatever the scheme's case, the parameter's
name or the text around it; what is not secret is kept."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from soakd.redact import redact_text, redact_url, redacted

SECRET = st.text(
    alphabet="abcdefghijkmnpqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789", min_size=6, max_size=24
).map(lambda s: "Zq9" + s)
SCHEME = st.sampled_from(["http", "https", "HTTP", "Https", "hTTp", "ftp", "redis", "postgres"])
PARAM = st.sampled_from(
    ["p", "password", "token", "access_token", "auth_token", "api_key", "apikey", "API-KEY", "secret",
     "client_secret", "sig", "X-Amz-Signature", "Authorization", "session"]
)  # fmt: skip
HOST = st.sampled_from(["db", "db.example.org:8086", "127.0.0.1:8000", "[::1]:9000"])


@given(SCHEME, HOST, SECRET, SECRET, PARAM)
def test_no_secret_survives_a_url(scheme: str, host: str, user: str, secret: str, param: str) -> None:
    for url in (
        f"{scheme}://{user}:{secret}@{host}/write?db=soakd",
        f"{scheme}://{host}/write?db=soakd&{param}={secret}",
        f"{scheme}://{secret}@{host}/",
        f"{scheme}://{host}/v1?{param}={secret}&x=1#frag",
    ):
        out = redact_url(url)
        assert secret not in out, (url, out)
        assert "db=soakd" in out or "db=" not in url  # what is not secret is kept
        text = f"influx at {url} refused: 401"
        assert secret not in redact_text(text) and redact_text(text).startswith("influx at ")


@given(SCHEME, HOST, SECRET, PARAM)
def test_no_secret_survives_a_config_dump(scheme: str, host: str, secret: str, param: str) -> None:
    doc = {
        "sinks": {"influx": {"url": f"{scheme}://u:{secret}@{host}/"}, "webhook": {"url": f"{scheme}://{host}/?{param}={secret}"}},
        "engine": {"server": {"env": {"HF_TOKEN": secret, "PATH": "/usr/bin"}, "extra_flags": [f"--url={scheme}://{host}/?{param}={secret}"]}},
    }  # fmt: skip
    out = redacted(doc)
    assert secret not in json.dumps(out)
    assert out["engine"]["server"]["env"]["PATH"] == "/usr/bin"


def test_unparsable_urls_are_a_placeholder_and_plain_text_is_untouched() -> None:
    assert redact_url("http://[::1") == "<invalid url>"
    assert redact_url("http://h:99999999/") == "<invalid url>"
    assert redact_text("no url here: models/tiny, 8 GB") == "no url here: models/tiny, 8 GB"
    assert redact_url("http://h:8086/query?db=s&epoch=ns") == "http://h:8086/query?db=s&epoch=ns"
