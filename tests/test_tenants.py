"""Tenants (deployments.tenants): a request's API key names its tenant at the ingress; the tenant's
priority range applies, and its prompts are cached under its own salt, so no tenant's cached_tokens
reveal another's prompts (the engine's side: tests/test_cache_salt.py)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from deployments.app import AppConfig, frontend_config
from deployments.errors import BadRequest, Unauthenticated
from deployments.requests import GenerateInput
from tests.serving_helpers import make_frontend, run

TENANTS = [{"name": "team-a", "api_keys": ["key-team-a-1", "key-team-a-2"], "allowed_priority": [-5, 0]},
           {"name": "team-b", "api_keys": ["key-team-b-1"]},
           {"name": "shared", "api_keys": ["key-shared-1"], "share_cache": True}]
FLAT_KEY = "key-of-no-tenant"


@pytest.fixture
def frontend(tokenizer):
    fe, _ = make_frontend(tokenizer, api_keys=(FLAT_KEY,))
    cfg = frontend_config(AppConfig.from_args({"api_keys": [FLAT_KEY], "tenants": TENANTS}))
    fe.config = dataclasses.replace(fe.config, tenants=cfg.tenants, allowed_priority=cfg.allowed_priority)
    return fe


def test_a_key_names_its_tenant_and_a_flat_key_none(frontend):
    assert frontend.authorize("Bearer key-team-a-2").name == "team-a"
    assert frontend.authorize("key-team-b-1").name == "team-b"
    assert frontend.authorize(f"Bearer {FLAT_KEY}") is None
    for bad in (None, "", "Bearer key-team-c-1"):
        with pytest.raises(Unauthenticated):
            frontend.authorize(bad)
    assert "key-team" not in repr(frontend.config.tenants)  # keys never reach a log line


def test_each_tenant_has_its_own_priority_range(frontend):
    async def main():
        a, b = frontend.authorize("Bearer key-team-a-1"), frontend.authorize("Bearer key-team-b-1")
        assert (await frontend.prepare(GenerateInput(prompt="hi", priority=-5), tenant=a)).priority == -5
        for tenant, whose in ((b, "tenant 'team-b' takes [0, 0] (tenants.allowed_priority)"),
                              (None, "this deployment takes [0, 0] (allowed_priority)")):
            with pytest.raises(BadRequest, match=re.escape(whose)) as info:
                await frontend.prepare(GenerateInput(prompt="hi", priority=-5), tenant=tenant)
            assert info.value.param == "priority"
    run(main())


def test_each_tenant_caches_its_prompts_apart_unless_it_shares(frontend):
    async def main():
        async def salt(key, client_salt=None):
            tenant = frontend.authorize(f"Bearer {key}")
            return (await frontend.prepare(GenerateInput(prompt="hi", cache_salt=client_salt), tenant=tenant)).cache_salt
        a1, a2, b = await salt("key-team-a-1"), await salt("key-team-a-2"), await salt("key-team-b-1")
        assert a1 == a2 and a1 is not None and b not in (None, a1)  # one tenant's keys share, tenants do not
        assert await salt("key-team-a-1", "x") not in (a1, "x")  # a client's salt divides its tenant's cache
        assert await salt("key-shared-1") is None and await salt("key-shared-1", "x") == "x"
        assert await salt(FLAT_KEY) is None
    run(main())


@pytest.mark.parametrize("tenants, message", [
    ([TENANTS[0], {**TENANTS[1], "name": "team-a"}], "tenant 'team-a' is named twice"),
    ([TENANTS[0], {**TENANTS[1], "api_keys": ["key-team-a-1"]}], "tenant 'team-b' has an API key that is given twice"),
    ([{**TENANTS[1], "api_keys": [FLAT_KEY]}], "given twice"),
    ([{**TENANTS[1], "api_keys": ["short"]}], "tenants.0.api_keys"),
    ([{**TENANTS[1], "name": "has space"}], "tenants.0.name"),
    ([{**TENANTS[1], "allowed_priority": [1, -1]}], "must be \\[lowest, highest\\]"),
    ([{**TENANTS[1], "weight": 0}], "tenants.0.weight"),
])
def test_bad_tenants_are_refused_by_name(tenants, message):
    with pytest.raises(ValueError, match=message) as info:
        AppConfig.from_args({"api_keys": [FLAT_KEY], "tenants": tenants})
    assert "key-team" not in str(info.value) and FLAT_KEY not in str(info.value)


def test_a_tenants_keys_come_from_a_file_that_rotates_without_restart(tokenizer, tmp_path, monkeypatch):
    from deployments.tenants import KeyList

    monkeypatch.setattr(KeyList, "CHECK_PERIOD_S", 0.0)  # re-read at every request
    a_keys, b_keys = tmp_path / "a", tmp_path / "b"
    a_keys.write_text("# team a\nkey-file-a-1\n")
    b_keys.write_text("key-file-b-1\n")
    cfg = frontend_config(AppConfig.from_args({"tenants": [{"name": "a", "api_keys_file": str(a_keys)},
                                                           {"name": "b", "api_keys_file": str(b_keys),
                                                            "api_keys": ["key-inline-b"]}]}))
    fe, _ = make_frontend(tokenizer)
    fe.config = dataclasses.replace(fe.config, tenants=cfg.tenants)
    assert [fe.authorize(f"Bearer {k}").name for k in ("key-file-a-1", "key-file-b-1", "key-inline-b")] == \
        ["a", "b", "b"]
    a_keys.write_text("key-file-a-2-rotated\n")  # a Secret renewed in place
    assert fe.authorize("Bearer key-file-a-2-rotated").name == "a"
    with pytest.raises(Unauthenticated):
        fe.authorize("Bearer key-file-a-1")
    b_keys.write_text("key-file-b-1\nkey-file-a-2-rotated\n")  # one key, two tenants: neither
    with pytest.raises(Unauthenticated):
        fe.authorize("Bearer key-file-a-2-rotated")
    with pytest.raises(ValueError, match="needs api_keys or an api_keys_file"):
        AppConfig.from_args({"tenants": [{"name": "c"}]})


def test_a_tenant_copied_to_another_process_reads_its_keys_file_there(tmp_path):
    """The app is built where Serve builds it and its config copied to the ingress replicas: the copy
    must not carry the builder's key list (its file stamps, its monotonic clock)."""
    import pickle

    from deployments.tenants import Tenant, tenant_of

    keys = tmp_path / "keys"
    keys.write_text("key-built-1\n")
    built = Tenant("a", (), api_keys_file=str(keys))
    assert tenant_of("key-built-1", (built,)) is built
    keys.write_text("key-rotated-22\n")
    copy = pickle.loads(pickle.dumps(built))
    assert "keys" not in copy.__dict__ and copy == built
    assert tenant_of("key-rotated-22", (copy,)) is copy and tenant_of("key-built-1", (copy,)) is None


def test_a_key_two_tenants_hold_is_logged_once_per_change_of_their_files(tmp_path, monkeypatch, caplog):
    from deployments.tenants import KeyList
    from deployments.tenants import Tenant, tenant_of

    monkeypatch.setattr(KeyList, "CHECK_PERIOD_S", 0.0)  # re-read at every request
    a_keys, b_keys = tmp_path / "a", tmp_path / "b"
    a_keys.write_text("key-clash-shared\n")
    b_keys.write_text("key-clash-shared\n")
    tenants = (Tenant("clash-a", (), api_keys_file=str(a_keys)), Tenant("clash-b", (), api_keys_file=str(b_keys)))

    def clashes() -> int:
        return sum("held by tenants clash-a, clash-b" in r.getMessage() for r in caplog.records)

    with caplog.at_level("ERROR", logger="deployments.tenants"):
        assert tenant_of("key-clash-shared", tenants) is None and tenant_of("key-clash-shared", tenants) is None
        assert clashes() == 1
        b_keys.write_text("key-clash-b-own\nkey-clash-shared\n")  # changed, still clashing: told again
        assert tenant_of("key-clash-shared", tenants) is None and tenant_of("key-clash-shared", tenants) is None
        assert clashes() == 2
    assert "key-clash-shared" not in caplog.text
