"""Teams (flatfare.gateway.console.team, .members, .roles) in one gateway process (tests/gateway/rig.py),
several console users each on an httpx client of their own: what each role opens, invitation links
(once, until they expire; a stale one is a page, not a 500), the last owner, removal revoking the keys
the member made unless they are moved, and the account's audit entries. The whole flow in a real
browser: tests/console/test_admin_pages.py (``test_a_team_in_the_browser...``)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from flatfare.gateway.console.mail import LOG_MARK
from tests.console.conftest import CSRF, PASSWORD, SECRET, new_email
from tests.conftest import VISIBLE_WITHIN_S
from tests.gateway.rig import Gateway, in_process_gateway

INVITE = re.compile(r"/console/invite/([A-Za-z0-9_-]{43})")


@pytest.fixture
async def gateway(redis_url: str, tmp_path: Path) -> AsyncIterator[Gateway]:
    async with in_process_gateway(redis_url, tmp_path, local_mode=True, console_team_invites_per_day=4,
                                  console_team_max_members=4) as gateway:
        yield gateway


class User:
    """One console user's browser: cookies, and the CSRF token of the last page."""

    def __init__(self, gateway: Gateway, caplog: pytest.LogCaptureFixture) -> None:
        self.gateway = gateway
        self.caplog = caplog
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app), base_url="http://gateway")
        self.csrf = ""
        self.email = ""

    async def get(self, path: str) -> httpx.Response:
        response = await self.http.get(path)
        if match := CSRF.search(response.text):
            self.csrf = match.group(1)
        return response

    async def post(self, path: str, **fields: str) -> httpx.Response:
        response = await self.http.post(path, data={"csrf_token": self.csrf, **fields})
        if match := CSRF.search(response.text):
            self.csrf = match.group(1)
        return response

    async def sign_up(self) -> User:
        self.email = new_email("owner")
        await self.get("/console/signup")
        assert (await self.post("/console/signup", email=self.email, password=PASSWORD)).status_code == 303
        await self.get("/console/team")
        return self

    async def invite(self, email: str, role: str) -> str:
        """The invitation's link token, read from the email (logged: no SMTP in local mode)."""
        self.caplog.clear()
        with self.caplog.at_level(logging.WARNING, logger="flatfare.console"):
            sent = await self.post("/console/team/invite", email=email, role=role)
        assert sent.status_code == 303, sent.text
        mails = [r.getMessage() for r in self.caplog.records if LOG_MARK in r.getMessage() and email in r.getMessage()]
        assert mails, "no invitation email"
        return INVITE.search(mails[-1]).group(1)

    async def join(self, gateway: Gateway, inviter: User, role: str) -> User:
        """Invited by ``inviter`` and accepted by signing up through the link."""
        self.email = new_email(role)
        token = await inviter.invite(self.email, role)
        await self.get(f"/console/invite/{token}")
        joined = await self.post(f"/console/invite/{token}", password=PASSWORD)
        assert joined.status_code == 303 and joined.headers["location"] == "/console?done=joined", joined.text
        await self.get("/console/team")
        return self

    async def make_key(self) -> tuple[int, str]:
        await self.get("/console/keys")
        made = await self.post("/console/keys", name="laptop")
        assert made.status_code == 201, made.text
        secret = SECRET.search(made.text).group(0)
        [(key_id,)] = await self.gateway.sql("SELECT id FROM api_keys WHERE prefix = :p", p=secret[:11])
        return key_id, secret


@pytest.fixture
async def people(gateway: Gateway, caplog: pytest.LogCaptureFixture) -> AsyncIterator[list[User]]:
    made: list[User] = []

    def person() -> User:
        made.append(User(gateway, caplog))
        return made[-1]

    yield person  # type: ignore[misc]
    for user in made:
        await user.http.aclose()


def _code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


async def _audit(gateway: Gateway, account_id: int) -> list[str]:
    return [a for (a,) in await gateway.sql("SELECT action FROM audit_log WHERE account_id = :a ORDER BY id",
                                             a=account_id)]


async def test_each_role_opens_only_its_pages(gateway: Gateway, people) -> None:  # noqa: ANN001
    owner = await people().sign_up()
    developer = await people().join(gateway, owner, "developer")
    billing = await people().join(gateway, owner, "billing")
    admin = await people().join(gateway, owner, "admin")
    # The developer: keys and usage, not the plan; no team management.
    for path in ("/console/keys", "/console/usage", "/console/playground", "/console/team", "/console/account"):
        assert (await developer.get(path)).status_code == 200, path
    for path in ("/console/billing", "/console/billing/status"):
        refused = await developer.http.get(path, headers={"hx-request": "true"})
        assert refused.status_code == 403 and _code(refused) == "role_forbidden", path
    assert (await developer.get("/console/billing")).status_code == 403  # a page, in the console's look
    await developer.get("/console/keys")
    for path, fields in (("/console/billing/checkout", {"plan": "pro"}), ("/console/trial", {}),
                         ("/console/team/invite", {"email": new_email(), "role": "developer"})):
        refused = await developer.post(path, **fields)
        assert refused.status_code == 403, (path, refused.text)
    assert 'href="/console/billing"' not in (await developer.get("/console")).text  # not offered either
    # Billing: plan and invoices only.
    assert (await billing.get("/console/billing")).status_code == 200
    for path in ("/console/keys", "/console/usage", "/console/usage.csv", "/console/playground", "/console/alerts"):
        assert (await billing.http.get(path, headers={"hx-request": "true"})).status_code == 403, path
    made = await billing.post("/console/keys", name="not mine to make")
    assert made.status_code == 403 and _code(made) == "role_forbidden"
    # An admin manages the team, but no owner: neither demotes, removes nor makes one.
    [(owner_id,)] = await gateway.sql("SELECT id FROM console_users WHERE email = :e", e=owner.email)
    for path, fields in ((f"/console/team/{owner_id}/role", {"role": "developer"}),
                         (f"/console/team/{owner_id}/remove", {}),
                         ("/console/team/invite", {"email": new_email(), "role": "owner"})):
        assert (await admin.post(path, **fields)).status_code == 403, path
    [(dev_id,)] = await gateway.sql("SELECT id FROM console_users WHERE email = :e", e=developer.email)
    assert (await admin.post(f"/console/team/{dev_id}/role", role="billing")).status_code == 303
    assert (await developer.http.get("/console/keys", headers={"hx-request": "true"})).status_code == 403


async def test_an_invitation_works_once_until_it_expires(gateway: Gateway, people) -> None:  # noqa: ANN001
    owner = await people().sign_up()
    member = people()
    member.email = new_email("member")
    token = await owner.invite(member.email, "developer")
    assert (await member.post(f"/console/invite/{token}", password=PASSWORD)).status_code == 403  # no CSRF page yet
    await member.get(f"/console/invite/{token}")
    assert (await member.post(f"/console/invite/{token}", password=PASSWORD)).status_code == 303
    # Used: the link is spent, for anyone (a page that says so, never a 500).
    other = people()
    used = await other.get(f"/console/invite/{token}")
    assert used.status_code == 410 and "already used" in used.text
    await other.get("/console/login")  # a CSRF token (the page of a spent link has no form)
    assert (await other.post(f"/console/invite/{token}", password=PASSWORD)).status_code == 410
    assert (await other.get("/console/invite/" + "x" * 43)).status_code == 404
    # Expired: refused.
    late = new_email("late")
    stale = await owner.invite(late, "developer")
    await gateway.sql("UPDATE account_invites SET expires_at = '2000-01-01 00:00:00' WHERE email = :e", e=late)
    expired = await other.get(f"/console/invite/{stale}")
    assert expired.status_code == 410 and "expired" in expired.text
    # A user who has an account of their own: someone else holding the link needs their password; they
    # accept while logged in, and may switch back to their own account.
    stranger = await people().sign_up()
    theirs = await owner.invite(stranger.email, "billing")
    again = await owner.post("/console/team/invite", email=stranger.email, role="admin")
    assert again.status_code == 409 and "pending invitation" in again.text
    await member.get(f"/console/invite/{theirs}")
    assert (await member.post(f"/console/invite/{theirs}", password="not the password")).status_code == 401
    await stranger.get(f"/console/invite/{theirs}")
    assert (await stranger.post(f"/console/invite/{theirs}")).status_code == 303
    assert (await stranger.get("/console/billing")).status_code == 200  # acting for the owner's account
    [(account_id,)] = await gateway.sql("SELECT account_id FROM console_users WHERE email = :e", e=owner.email)
    [(own,)] = await gateway.sql("SELECT m.account_id FROM account_members m JOIN console_users u ON u.id = m.user_id "
                                 "WHERE u.email = :e AND m.account_id != :a", e=stranger.email, a=account_id)
    for not_theirs in (str(account_id + 1000), "9" * 12, "x"):
        assert (await stranger.post("/console/team/switch", account_id=not_theirs)).status_code == 404
    assert (await stranger.post("/console/team/switch", account_id=str(own))).status_code == 303
    assert (await stranger.get("/console/keys")).status_code == 200  # their own account, where they own
    # Bounded: invitations a day (4 here), members (4, pending invitations count), the address's length.
    assert (await owner.post("/console/team/invite", email=new_email(), role="billing")).status_code == 303
    refused = await owner.post("/console/team/invite", email=new_email(), role="billing")
    assert refused.status_code == 429 and "invitations in the last day" in refused.text
    await gateway.sql("DELETE FROM account_invites WHERE accepted_at IS NOT NULL OR email = :e", e=late)
    full = await owner.post("/console/team/invite", email=new_email(), role="billing")
    assert full.status_code == 409 and "at most 4 members" in full.text
    assert (await owner.post("/console/team/invite", email="a" * 250 + "@b.co", role="billing")).status_code == 400
    assert (await _audit(gateway, account_id)).count("member.join") == 2


async def test_the_last_owner_can_neither_leave_nor_be_demoted(gateway: Gateway, people) -> None:  # noqa: ANN001
    owner = await people().sign_up()
    [(owner_id, account_id)] = await gateway.sql("SELECT id, account_id FROM console_users WHERE email = :e",
                                                 e=owner.email)
    left = await owner.post("/console/team/leave")
    assert left.status_code == 409 and "last owner" in left.text
    assert (await owner.post(f"/console/team/{owner_id}/role", role="admin")).status_code == 409
    second = await people().join(gateway, owner, "owner")
    assert (await owner.post("/console/team/leave")).status_code == 303
    [(second_id,)] = await gateway.sql("SELECT id FROM console_users WHERE email = :e", e=second.email)
    assert await gateway.sql("SELECT user_id, role FROM account_members WHERE account_id = :a",
                             a=account_id) == [(second_id, "owner")]
    gone = await owner.http.get("/console/keys")  # no account left: logged out
    assert gone.status_code == 303 and gone.headers["location"] == "/console/login"


async def test_removing_a_member_revokes_the_keys_they_made_unless_moved(  # noqa: ANN001 - people: a factory
        gateway: Gateway, people) -> None:
    owner = await people().sign_up()
    leaver = await people().join(gateway, owner, "developer")
    keeper = await people().join(gateway, owner, "developer")
    [(account_id,)] = await gateway.sql("SELECT account_id FROM console_users WHERE email = :e", e=owner.email)
    ids = {u.email: (await gateway.sql("SELECT id FROM console_users WHERE email = :e", e=u.email))[0][0]
           for u in (owner, leaver, keeper)}
    revoked_id, revoked_secret = await leaver.make_key()
    moved_id, moved_secret = await keeper.make_key()
    keys_page = (await owner.get("/console/keys")).text  # who made each key
    makers = re.findall(r'<tr data-key-id="(\d+)">.*?data-field="made_by">([^<]+)<', keys_page, re.S)
    assert {(int(k), e) for k, e in makers} >= {(revoked_id, leaver.email), (moved_id, keeper.email)}, makers

    async def answers(secret: str) -> int:
        return (await gateway.client.get("/v1/models", headers={"Authorization": f"Bearer {secret}"})).status_code

    assert await answers(revoked_secret) == 200
    await owner.get("/console/team")
    assert (await owner.post(f"/console/team/{ids[leaver.email]}/remove", move_keys_to="")).status_code == 303
    deadline = asyncio.get_running_loop().time() + VISIBLE_WITHIN_S  # the auth cache's lifetime
    while (status := await answers(revoked_secret)) != 401:
        assert asyncio.get_running_loop().time() < deadline, f"the removed member's key still answers {status}"
        await asyncio.sleep(0.05)
    assert (await leaver.http.get("/console/keys")).status_code == 303  # their session ended
    # Moved, not revoked: the key keeps working, now the owner's.
    assert (await owner.post(f"/console/team/{ids[keeper.email]}/remove",
                             move_keys_to=str(ids[owner.email]))).status_code == 303
    assert await answers(moved_secret) == 200
    assert await gateway.sql("SELECT revoked_at IS NULL, created_by_user_id FROM api_keys WHERE id = :k",
                             k=moved_id) == [(1, ids[owner.email])]
    actions = await _audit(gateway, account_id)
    assert [a for a in actions if a in ("key.create", "key.revoke", "member.remove", "key.move")] == [
        "key.create", "key.create", "key.revoke", "member.remove", "key.move", "member.remove"], actions
    assert actions.count("member.invite") == 2 and actions.count("member.join") == 2
    activity = (await owner.get("/console/team")).text
    assert "member.remove" in activity and "key.revoke" in activity
    assert revoked_id != moved_id
