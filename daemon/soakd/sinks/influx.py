"""Writers that put batches of line-protocol lines into InfluxDB, turning every failure into SinkError.

`V1Writer` speaks `POST /write` (1.x, and the v1 compatibility API of 2.x/3.x) over httpx; `V2Writer`
uses influxdb-client's synchronous write API for `/api/v2/write` (1.8+, 2.x, 3.x). Neither keeps data:
the spool does, and the forwarder retries a failed batch.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, cast

import httpx
import structlog
import urllib3.exceptions
from influxdb_client.client.exceptions import InfluxDBError
from influxdb_client.client.influxdb_client import InfluxDBClient
from influxdb_client.client.write_api import SYNCHRONOUS
from influxdb_client.domain.write_precision import WritePrecision
from influxdb_client.rest import ApiException

from soakd.config import InfluxConfig
from soakd.errors import ConfigError, SinkError, SinkRejected
from soakd.files import read_credential

log = structlog.get_logger(__name__)

_MAX_REASON = 300


class LineWriter(Protocol):
    """A sink for line-protocol lines. Every method raises SinkError (with a short reason) on failure."""

    async def write(self, lines: Sequence[str]) -> None:
        """Write the lines; return only when the server has accepted all of them."""
        ...

    async def ping(self) -> str:
        """The server's version (or "unknown"); raises SinkError when the server does not answer."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 3] + "..."


def _server_message(body: bytes | str) -> str:
    """The error text of an InfluxDB error body ({"error": ...} on 1.x, {"message": ...} on 2.x)."""
    text = body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except ValueError:
        return _short(text)
    if isinstance(data, dict):
        for key in ("error", "message"):
            if isinstance(data.get(key), str):
                return _short(data[key])
    return _short(text)


def _quote_ident(name: str) -> str:
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


class V1Writer:
    """`POST {url}/write?db=&rp=&precision=ns`, basic auth when a username is set."""

    def __init__(
        self,
        url: str,
        database: str,
        retention_policy: str = "",
        username: str = "",
        password: str = "",
        *,
        timeout_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.database = database
        self.retention_policy = retention_policy
        auth = httpx.BasicAuth(username, password) if username else None
        self._client = httpx.AsyncClient(timeout=timeout_s, auth=auth, transport=transport)

    async def write(self, lines: Sequence[str]) -> None:
        if not lines:
            return
        params = {"db": self.database, "precision": "ns"}
        if self.retention_policy:
            params["rp"] = self.retention_policy
        body = "\n".join(lines).encode("utf-8")
        response = await self._request("POST", "/write", params=params, content=body)
        if response.status_code == 404 and b"database not found" in response.content:
            # A fresh server, or the database was dropped mid-run: create it and write again.
            await self.create_database()
            response = await self._request("POST", "/write", params=params, content=body)
        # 1.x answers 204; a 4xx with "partial write" means some points were dropped: that is a failure.
        if response.status_code == 400:
            raise SinkRejected(f"HTTP 400: {_server_message(response.content)}")
        if not response.is_success:
            raise SinkError(f"HTTP {response.status_code}: {_server_message(response.content)}")

    async def ping(self) -> str:
        response = await self._request("GET", "/ping")
        if not response.is_success:
            raise SinkError(f"ping: HTTP {response.status_code}: {_server_message(response.content)}")
        return str(response.headers.get("X-Influxdb-Version", "unknown"))

    async def create_database(self) -> None:
        """`CREATE DATABASE` (a no-op when it exists). Raises SinkError when refused."""
        query = f"CREATE DATABASE {_quote_ident(self.database)}"
        response = await self._request("POST", "/query", data={"q": query})
        if not response.is_success:
            raise SinkError(
                f"create database: HTTP {response.status_code}: {_server_message(response.content)}"
            )
        # /query reports a failed statement with 200 and an "error" inside the results.
        try:
            results = response.json().get("results", [])
        except ValueError:
            return
        for result in results:
            if isinstance(result, dict) and isinstance(result.get("error"), str):
                raise SinkError(f"create database: {_short(result['error'])}")

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return await self._client.request(method, self.url + path, **kwargs)
        except httpx.HTTPError as err:
            raise SinkError(f"{path}: {type(err).__name__}: {_short(str(err)) or 'no detail'}") from err


class V2Writer:
    """`/api/v2/write` through influxdb-client's synchronous API, run in a worker thread.

    Against 1.8+ pass `token="user:password"` and `bucket="db/rp"` (org is ignored there).
    """

    def __init__(self, url: str, org: str, bucket: str, token: str, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.org = org
        self.bucket = bucket
        # Never the batching write API: it keeps unsent points only in memory and drops them on exit.
        self._client = InfluxDBClient(url=self.url, token=token, org=org, timeout=int(timeout_s * 1000))
        self._write_api = self._client.write_api(write_options=SYNCHRONOUS)

    async def write(self, lines: Sequence[str]) -> None:
        if not lines:
            return
        try:
            await asyncio.to_thread(self._write_blocking, "\n".join(lines))
        except (InfluxDBError, urllib3.exceptions.HTTPError, OSError) as err:
            raise SinkError(_describe(err)) from err

    def _write_blocking(self, record: str) -> None:
        # The generated "enum" holds plain strings; the client's annotation names the class.
        precision = cast(WritePrecision, WritePrecision.NS)
        self._write_api.write(bucket=self.bucket, org=self.org, record=record, write_precision=precision)

    async def ping(self) -> str:
        try:
            version: str = await asyncio.to_thread(self._client.version)
        except (InfluxDBError, urllib3.exceptions.HTTPError, OSError) as err:
            raise SinkError("ping: " + _describe(err)) from err
        return version

    async def aclose(self) -> None:
        await asyncio.to_thread(self._client.close)


def _describe(err: InfluxDBError | urllib3.exceptions.HTTPError | OSError) -> str:
    if isinstance(err, ApiException):
        body = err.body if isinstance(err.body, bytes | str) else b""
        message = _server_message(body) if body else str(err.reason)
        return f"HTTP {err.status}: {message}"
    if isinstance(err, InfluxDBError):
        return _short(str(err.message))
    return f"{type(err).__name__}: {_short(str(err))}"


def read_secret(name: str, env: Mapping[str, str], *, key: str) -> str:
    """The secret `name` names: the systemd credential of that name (LoadCredential=NAME:...) when the
    service manager passed one in $CREDENTIALS_DIRECTORY, else the environment variable, else "".

    A credential never enters the process environment, so the engine's processes and /proc/PID/environ
    never see it. The value is never logged; errors name the file and the config key (`key`), not the value.
    """
    directory = env.get("CREDENTIALS_DIRECTORY", "")
    # A name from the config becomes a file name: one path component, nothing that walks out.
    if directory and name and "/" not in name and name not in (".", ".."):
        path = Path(directory) / name
        text = read_credential(path, ConfigError, key=key)
        if text is not None:
            if name in env:
                log.warning("influx_secret_from_credential", name=name, ignored="environment variable")
            return text
    return env.get(name, "")


def make_writer(cfg: InfluxConfig, env: Mapping[str, str]) -> LineWriter:
    """The writer `cfg.api` asks for. Secrets: the systemd credentials or environment variables named by
    `password_env` / `token_env` (read_secret), read only when this api uses them."""
    if cfg.api == "v1":
        return V1Writer(
            cfg.url,
            cfg.database,
            retention_policy=cfg.retention_policy,
            username=cfg.username,
            password=read_secret(cfg.password_env, env, key="sinks.influx.password_env"),
            timeout_s=cfg.timeout,
        )
    bucket = cfg.bucket or (
        f"{cfg.database}/{cfg.retention_policy}" if cfg.retention_policy else cfg.database
    )
    token = read_secret(cfg.token_env, env, key="sinks.influx.token_env")
    if not token and cfg.username:
        # InfluxDB 1.8's v2 API takes "user:password" as its token.
        token = f"{cfg.username}:{read_secret(cfg.password_env, env, key='sinks.influx.password_env')}"
    return V2Writer(cfg.url, cfg.org, bucket, token, timeout_s=cfg.timeout)
