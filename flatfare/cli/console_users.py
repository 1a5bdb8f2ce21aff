"""``flatfare console-users``: console users made by an operator (an invite-only console, admin users).
Writes to the database directly, like ``flatfare admin bootstrap``."""

from __future__ import annotations

import asyncio
import sys
from typing import Annotated

import typer

from flatfare.settings import CommonSettings

app = typer.Typer(help="Web console users (an invite-only console's customers; admin users).", no_args_is_help=True)


@app.command("create")
def create(
    email: Annotated[str, typer.Argument(help="The user's email; they log in with it.")],
    account: Annotated[str | None, typer.Option(
        help="The account they act for (created if missing). Default: an account named after the email.")] = None,
    plan: Annotated[str | None, typer.Option(help="Plan for a new account (default free).")] = None,
    admin: Annotated[bool, typer.Option("--admin", help="A platform admin, with no account of their own.")] = False,
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read the password from stdin.")] = False,
) -> None:
    """Create a console user (confirmed) and print their id."""
    from flatfare.gateway.console.users import ConsoleUserError, check_new_password, create_user, normalize_email
    from flatfare.gateway.settings import GatewaySettings
    from flatfare.storage.accounts import AccountError
    from flatfare.billing.plan_change import ensure_account
    from flatfare.storage.db import one_session

    settings = GatewaySettings()
    password = sys.stdin.readline().rstrip("\n") if password_stdin else typer.prompt(
        "Password", hide_input=True, confirmation_prompt=True)
    try:
        email = normalize_email(email)
        check_new_password(password, settings.console_min_password_length)
    except ConsoleUserError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc

    async def run() -> int:
        async with one_session(CommonSettings().resolved_database_url) as session:
            account_id = None
            if not admin:
                account_id = (await ensure_account(session, account or email, plan)).id
            user = await create_user(session, email, password, account_id=account_id, is_admin=admin)
            await session.commit()
            return user.id

    try:
        typer.echo(asyncio.run(run()))
    except AccountError as exc:
        typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from exc
