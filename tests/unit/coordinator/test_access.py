"""Who sees what: with an API key the status page needs it too (it lists the engines);
engine addresses in a request's timings are for the admin key alone."""

from __future__ import annotations

import base64

import httpx

from tests.unit.coordinator.harness import BODY, serve

TIMINGS = {"x-pdserve-timings": "1"}


def keys(tmp_path, **named) -> dict[str, str]:
    """Writes each key to a file; returns the settings naming the files."""
    files = {}
    for name, key in named.items():
        (tmp_path / name).write_text(key + "\n")
        files[f"{name}_file"] = str(tmp_path / name)
    return files


def basic(password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"me:{password}".encode()).decode()}


def test_the_status_page_needs_the_api_key(loop, stubs, tmp_path):
    with serve(loop, [stubs()], **keys(tmp_path, api_key="k1")) as app:
        for path in ("/ui", "/ui/state", "/ui/app.js"):
            r = httpx.get(app.url + path)
            assert r.status_code == 401, path
            assert r.headers["www-authenticate"].startswith("Basic")  # the browser asks
            assert httpx.get(app.url + path, headers=basic("nope")).status_code == 401
            assert httpx.get(app.url + path, headers=basic("k1")).status_code == 200
            assert httpx.get(app.url + path, headers={"Authorization": "Bearer k1"}).status_code == 200
        assert httpx.get(app.url + "/ui/state", headers=basic("k1")).json()["instances"]
        assert httpx.get(app.url + "/").status_code == 307  # a redirect, nothing shown
        for path in ("/health", "/ready", "/metrics"):
            assert httpx.get(app.url + path).status_code == 200
        # Basic auth is for the page a browser opens, not the API.
        assert httpx.post(app.url + "/v1/completions", json=BODY, headers=basic("k1")).status_code == 401


def test_timings_name_the_engines_for_the_admin_key_only(loop, stubs, tmp_path):
    engines = [stubs(role="prefill"), stubs(role="decode", num_tokens=2)]
    with serve(loop, engines, **keys(tmp_path, api_key="k1", admin_key="a1")) as app:
        def timings(key: str) -> dict:
            r = httpx.post(app.url + "/v1/completions", json=BODY, timeout=10,
                           headers={**TIMINGS, "Authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
            return r.json()["pdserve_timings"]

        client = timings("k1")
        assert "prefill_instance" not in client and "decode_instance" not in client
        assert client["route_s"] >= 0 and client["attempts"] == 1 and client["e2e_s"] > 0
        admin = timings("a1")  # the admin key is an API key too
        assert (admin["prefill_instance"], admin["decode_instance"]) == tuple(engines)
        stream = httpx.post(app.url + "/v1/completions", timeout=10,
                            json={**BODY, "stream": True},
                            headers={**TIMINGS, "Authorization": "Bearer k1"})
        assert '"prefill_instance"' not in stream.text and '"route_s"' in stream.text
        assert httpx.get(app.url + "/ui/state", headers=basic("a1")).status_code == 200


def test_without_an_admin_key_nobody_sees_engine_addresses(loop, stubs):
    engines = [stubs(role="prefill"), stubs(role="decode", num_tokens=2)]
    with serve(loop, engines) as app:
        r = httpx.post(app.url + "/v1/completions", json=BODY, headers=TIMINGS, timeout=10)
        t = r.json()["pdserve_timings"]
        assert "prefill_instance" not in t and t["request_id"] == r.headers["x-request-id"]
        assert not any(address in r.text for address in engines)


def test_an_admin_key_alone_guards_the_status_page_not_the_api(loop, stubs, tmp_path):
    with serve(loop, [stubs()], **keys(tmp_path, admin_key="a1")) as app:
        assert httpx.get(app.url + "/ui/state").status_code == 401
        assert httpx.get(app.url + "/ui/state", headers=basic("a1")).status_code == 200
        assert httpx.post(app.url + "/v1/completions", json=BODY, timeout=10).status_code == 200
