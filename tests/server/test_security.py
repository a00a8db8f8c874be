"""The API key, the Host check and the CSRF guard over real HTTP, on a second live server that
shares the session's engine and has --api-key set (the official openai client where it
applies)."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import API_KEY as KEY
from test_http import assert_openai_error

from deltaserve.server.security import ServerOptions, host_allowed, host_name, is_loopback

GREEDY = {"temperature": 0, "ignore_eos": True}
# every route, with a request that succeeds when the key is right
ROUTES = [
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **GREEDY}),
    ("POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **GREEDY}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/{model}", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/cache/status", None),
    ("POST", "/v1/cache/flush", None),
]


def call(base_url: str, method: str, path: str, body: dict | None, model: str,
         headers: dict[str, str] | None = None) -> httpx.Response:
    with httpx.Client(base_url=base_url, timeout=30) as c:
        return c.request(method, path.format(model=model), json=body, headers=headers)


@pytest.mark.parametrize("method,path,body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_every_keyed_route_is_401_without_or_with_a_wrong_key_and_200_with_it(
        keyed, served, method, path, body):
    missing = call(keyed, method, path, body, served.model)
    error = assert_openai_error(missing, 401, None)
    assert "API key" in error["message"] and missing.headers["www-authenticate"] == "Bearer"
    wrong = call(keyed, method, path, body, served.model,
                 {"Authorization": "Bearer sk-wrong"})
    assert assert_openai_error(wrong, 401, None)["code"] == "invalid_api_key"
    assert "sk-wrong" not in wrong.text  # a wrong key is never echoed back
    not_bearer = call(keyed, method, path, body, served.model, {"Authorization": KEY})
    message = assert_openai_error(not_bearer, 401, None)["message"]
    assert "not a Bearer token" in message and KEY not in not_bearer.text
    right = call(keyed, method, path, body, served.model, {"Authorization": f"Bearer {KEY}"})
    assert right.status_code == 200, right.text


def test_health_docs_and_the_schema_stay_open_and_the_schema_declares_the_bearer_scheme(keyed):
    with httpx.Client(base_url=keyed, timeout=30) as c:
        assert c.get("/health").json() == {"status": "ok"}
        assert "swagger" in c.get("/docs").text.lower()
        schema = c.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert schema["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in schema["paths"]["/health"]["get"]


def test_the_official_client_is_refused_without_the_key_and_served_with_it(keyed, served):
    wrong = openai.OpenAI(base_url=f"{keyed}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401
    right = openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in right.models.list().data] == [served.model]
    out = right.completions.create(model=served.model, prompt="Hi", max_tokens=2,
                                   temperature=0)
    assert out.usage.completion_tokens == 2


def test_a_loopback_server_refuses_a_foreign_host_header_a_dns_rebinding_page_would_send(
        keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=keyed, timeout=30) as c:
        foreign = c.get("/health", headers={"Host": "attacker.example:8000"})
        assert assert_openai_error(foreign, 400, "Host")["code"] == "invalid_host"
        for host in ("localhost:1234", "127.0.0.1", "[::1]:8000", "LOCALHOST"):
            assert c.get("/v1/models", headers={**auth, "Host": host}).status_code == 200


@pytest.mark.parametrize("headers,body", [
    ({"Content-Type": "text/plain", "Origin": "https://evil.example"}, b"{}"),
    ({"Content-Type": "text/plain"}, b"x"),  # a browser without Origin on the request
    ({"Content-Type": "application/x-www-form-urlencoded"}, b"a=1"),
    ({"Origin": "null"}, b""),  # a sandboxed page's no-cors POST carries no Content-Type
    ({"Sec-Fetch-Site": "cross-site"}, b""),
], ids=["text-plain-origin", "text-plain", "form", "origin-null", "sec-fetch-site"])
def test_a_cross_site_flush_is_refused_and_the_cache_is_kept(client, served, headers, body):
    client.post("/v1/completions", json={"prompt": "Hello there, cache me " * 20,
                                          "max_tokens": 1, **GREEDY})
    before = client.get("/v1/cache/status").json()
    assert before["pages_cached"] > 0
    r = client.post("/v1/cache/flush", content=body, headers=headers)
    assert assert_openai_error(r, 403, None)["code"] == "cross_site_request"
    assert client.get("/v1/cache/status").json()["pages_cached"] == before["pages_cached"]


def test_a_same_origin_or_non_browser_flush_is_accepted(client, served):
    host = served.base_url.removeprefix("http://")
    same = client.post("/v1/cache/flush", headers={"Origin": served.base_url, "Host": host})
    assert same.status_code == 200 and same.json()["flushed"] is True
    as_json = client.post("/v1/cache/flush", json={})
    assert as_json.status_code == 200


def test_a_cross_site_generation_post_is_refused_before_it_runs(client):
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                    headers={"Origin": "https://evil.example"})
    assert_openai_error(r, 403, None)


def test_a_method_a_route_does_not_take_is_405_with_allow(client):
    for method, path, allow in [("GET", "/v1/completions", {"POST"}),
                                ("DELETE", "/v1/models", {"GET"}),
                                ("PUT", "/v1/cache/flush", {"POST"}),
                                ("POST", "/health", {"GET", "HEAD"})]:
        r = client.request(method, path)
        assert_openai_error(r, 405, None)
        assert {m.strip() for m in r.headers["allow"].split(",")} == allow, (method, path)


@pytest.mark.parametrize("header,name", [("localhost:8000", "localhost"),
                                         ("[::1]:8000", "::1"), ("Example.COM", "example.com"),
                                         ("::1", "::1"), ("", ""),
                                         ("localhost.:8000", "localhost"),
                                         ("Example.com.", "example.com"), (".", ""),
                                         ("evil..", "evil..")])
def test_the_host_name_drops_the_port_case_and_final_dot(header, name):
    assert host_name(header) == name


def test_host_entries_match_exactly_by_subdomain_or_anything():
    allowed = ("api.example.com", ".internal")
    assert host_allowed("api.example.com", allowed)
    assert host_allowed("internal", allowed) and host_allowed("a.b.internal", allowed)
    assert not host_allowed("example.com", allowed)
    assert not host_allowed("evilinternal", allowed)
    assert host_allowed("anything", ("*",))


def test_a_loopback_address_matches_an_allowed_loopback_address_but_no_name_does():
    loopback = ServerOptions.for_bind("127.0.0.1").allowed_hosts
    for name in ("127.0.0.1", "127.0.0.2", "127.255.0.9", "::1", "localhost"):
        assert host_allowed(name, loopback), name
    for name in ("127.0.0.2.evil.example", "evil.example", "10.0.0.1", "0.0.0.0"):
        assert not host_allowed(name, loopback), name
    assert not host_allowed("127.0.0.2", ("localhost",))  # a name entry matches names only
    assert not host_allowed("127.0.0.2", ("api.example.com",))


def test_the_default_hosts_follow_the_bind_address():
    assert ServerOptions.for_bind("127.0.0.1").allowed_hosts == ("localhost", "127.0.0.1", "::1")
    assert ServerOptions.for_bind("0.0.0.0").allowed_hosts == ("*",)
    given = ServerOptions.for_bind("0.0.0.0", allowed_hosts=["A.example, b.example.", "c"])
    assert given.allowed_hosts == ("a.example", "b.example", "c")
    assert is_loopback("::1") and is_loopback("localhost") and not is_loopback("0.0.0.0")


@pytest.mark.parametrize("kwargs,says", [({"api_key": " "}, "--api-key"),
                                         ({"max_request_bytes": 10}, "--max-request-bytes"),
                                         ({"allowed_hosts": ()}, "--allowed-hosts")])
def test_bad_server_options_are_refused_naming_the_flag(kwargs, says):
    with pytest.raises(ValueError, match=says):
        ServerOptions(**kwargs)


def serve_options(*argv: str, environ: dict[str, str] | None = None) -> ServerOptions:
    from deltaserve.server.cli import build_parser
    from deltaserve.server.security import server_options

    return server_options(build_parser().parse_args(["serve", *argv]), environ or {})


def test_the_serve_flags_and_the_environment_set_the_server_options():
    default = serve_options()
    assert default.api_key is None and default.allowed_hosts == ("localhost", "127.0.0.1", "::1")
    assert serve_options(environ={"DELTASERVE_API_KEY": "k1"}).api_key == "k1"
    flags = serve_options("--api-key", "k2", "--host", "0.0.0.0", "--allowed-hosts", "a.example",
                          "--allowed-hosts", ".b.example", "--max-request-bytes", "2048",
                          environ={"DELTASERVE_API_KEY": "k1"})
    assert flags == ServerOptions(api_key="k2", allowed_hosts=("a.example", ".b.example"),
                                  max_request_bytes=2048)
    assert serve_options("--host", "0.0.0.0").allowed_hosts == ("*",)


def test_a_bad_server_flag_stops_serve_before_the_model_loads(capsys, monkeypatch):
    from deltaserve.server import cli

    monkeypatch.setattr(cli, "_make_engine", lambda args: pytest.fail("the model was loaded"))
    assert cli.main(["serve", "--max-request-bytes", "10"]) == 1
    assert "--max-request-bytes" in capsys.readouterr().err
