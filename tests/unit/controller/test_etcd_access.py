"""``EtcdStore`` against real etcd servers secured as in production: every endpoint of
the list is used (a dead first one, one cut while in use), TLS with client
certificates (refused without one, or against another CA), and etcd's users (a
user confined to ``/pdserve/``, a wrong password refused, a token etcd forgot on
restart fetched again)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.controller.etcd_store import EtcdAccess, EtcdStore
from pdserve.controller.store import StoreError, open_store
from tests.etcd import EtcdServer, TcpProxy, free_port
from tests.pki import issue, make_ca


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("pki")
    make_ca(cwd, "etcd-ca")
    make_ca(cwd, "other-ca")
    return {name: issue(cwd, name, ca) for name, ca in
            [("etcd", "etcd-ca"), ("controller", "etcd-ca"), ("stranger", "other-ca")]}


async def roundtrip(store, key: str = "/pdserve/t/k") -> str | None:
    lease = await store.grant_lease(5)
    await store.put(key, "v", lease)
    assert await store.refresh_lease(lease)
    value = await store.get(key)
    await store.revoke_lease(lease)
    return value


def test_a_dead_first_endpoint_is_skipped_and_a_cut_one_is_left(tmp_path):
    etcd = EtcdServer(tmp_path / "data").start()
    proxy = TcpProxy(etcd.client_port)
    try:
        async def go():
            dead = f"127.0.0.1:{free_port()}"
            store = open_store(f"etcd://{dead},{etcd.endpoint}")
            assert await roundtrip(store) == "v"
            assert store.address == etcd.endpoint  # later calls stay on the one that answered
            await store.close()

            # in use, then partitioned: the next calls go to the other member's endpoint
            store = EtcdStore([f"127.0.0.1:{proxy.port}", etcd.endpoint], timeout_s=2.0)
            lease = await store.grant_lease(10)
            await store.put("/pdserve/t/leased", "1", lease)
            assert store.address == f"127.0.0.1:{proxy.port}"
            proxy.hang()
            started = asyncio.get_running_loop().time()
            assert await store.get("/pdserve/t/leased") == "1"  # one deadline, split over both
            assert asyncio.get_running_loop().time() - started < 2.0
            assert store.address == etcd.endpoint
            assert await store.refresh_lease(lease)  # the lease is the cluster's, not the endpoint's
            assert await store.get("/pdserve/t/leased") == "1"
            await store.close()

        asyncio.run(go())
    finally:
        proxy.close()
        etcd.stop()


def test_tls_with_a_client_certificate_and_nothing_less(tmp_path, pki):
    etcd = EtcdServer(tmp_path / "data", tls=pki["etcd"]).start()
    mine, stranger = pki["controller"], pki["stranger"]
    try:
        async def outcome(access: EtcdAccess | None) -> str:
            store = EtcdStore([etcd.endpoint], access, timeout_s=2.0)
            try:
                return await roundtrip(store)
            except StoreError:
                return "refused"
            finally:
                await store.close()

        async def go():
            return {
                "signed": await outcome(EtcdAccess(mine.tls_ca, mine.tls_cert, mine.tls_key)),
                "plain text": await outcome(None),
                "no client certificate": await outcome(EtcdAccess(ca_file=mine.tls_ca)),
                "certificate of another CA": await outcome(EtcdAccess(mine.tls_ca, stranger.tls_cert,
                                                                      stranger.tls_key)),
                "server checked against another CA": await outcome(
                    EtcdAccess(stranger.tls_ca, mine.tls_cert, mine.tls_key)),
            }

        assert asyncio.run(go()) == {"signed": "v", "plain text": "refused", "no client certificate": "refused",
                                     "certificate of another CA": "refused",
                                     "server checked against another CA": "refused"}
    finally:
        etcd.stop()


def test_a_user_confined_to_its_prefix_logs_in_again_after_etcd_restarts(tmp_path):
    etcd = EtcdServer(tmp_path / "data").start()
    etcd.enable_auth("pdserve", "s3cret", "/pdserve/")
    (tmp_path / "password").write_text("s3cret\n")
    try:
        async def go():
            access = EtcdAccess.from_files(user="pdserve", password_file=str(tmp_path / "password"))
            store = EtcdStore([etcd.endpoint], access)
            assert await roundtrip(store) == "v"
            with pytest.raises(StoreError, match="permission denied"):
                await store.put("/elsewhere", "x")
            anonymous = EtcdStore([etcd.endpoint])
            with pytest.raises(StoreError):
                await anonymous.put("/pdserve/t/anon", "x")
            wrong = EtcdStore([etcd.endpoint], EtcdAccess(user="pdserve", password="nope"))
            with pytest.raises(StoreError, match="authentication failed"):
                await wrong.get("/pdserve/t/k")
            await asyncio.to_thread(etcd.restart)  # etcd forgets every token it gave
            assert await roundtrip(store) == "v"
            for s in (store, anonymous, wrong):
                await s.close()

        asyncio.run(go())
    finally:
        etcd.stop()


def test_access_needs_its_pairs():
    with pytest.raises(ValueError, match="cert and the key"):
        EtcdAccess(cert_file="c.crt")
    with pytest.raises(ValueError, match="user and a password"):
        EtcdAccess(user="pdserve")
    assert "s3cret" not in repr(EtcdAccess(user="u", password="s3cret"))
