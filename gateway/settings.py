"""The gateway process's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, PositiveFloat, SecretStr, model_validator

from flatfare.billing.stripe_client import StripeConfig
from flatfare.contract import timing
from flatfare.settings import CommonSettings


class GatewaySettings(CommonSettings):
    host: str = "127.0.0.1"
    port: int = 8000
    # The HTTP server of `flatfare gateway`: uvicorn (httptools, uvloop) or granian (Rust). Measured
    # side by side in bench/results/overhead.md: the same requests/s a core from 32 clients on, each
    # ahead at some low concurrencies; uvicorn stays the default.
    server: Literal["uvicorn", "granian"] = "uvicorn"
    # Peers whose X-Forwarded-For / -Proto the HTTP server believes (addresses or networks, comma
    # separated): the reverse proxy in front. Only then does each client get its own login-attempt
    # counter; everything else is seen as the peer's own address.
    forwarded_allow_ips: str = "127.0.0.1"
    # Largest request body accepted, in bytes (plans may lower it); larger ones get 413.
    max_body_bytes: int = 8 * 1024 * 1024
    # How long an idle client connection stays open (uvicorn; granian keeps it until the client closes). Longer
    # than any client's or load balancer's own idle limit (httpx and the OpenAI SDKs: 5 s; AWS ALB: 60 s), so
    # the client always closes first: with equal limits a client sends a request on a connection the
    # gateway is closing at that moment, and it fails with a connection error (uvicorn's default is 5 s).
    keep_alive_s: float = Field(default=65.0, gt=0, le=3600)
    # How long a request sent with an Idempotency-Key is replayed to a retry with the same key: its answer
    # is kept in Redis that long (ff:reply:{id}, about 4 KiB each; docs/OPERATIONS.md sizes Redis by it).
    idempotency_window_s: int = Field(default=24 * 3600, ge=60, le=7 * 24 * 3600)
    # At shutdown, how long a background pass (files and responses expiry, batch dispatch, the billing
    # outbox, quota alerts, shared-key notices) may finish the pass it is in before it is cancelled.
    shutdown_grace_s: float = Field(default=10.0, gt=0)
    # How long a request may wait for its worker's answer, queued and running together.
    request_timeout_s: float = 600.0
    # A request for a model with no warm worker, admitted because a fleet supervisor or an external
    # scaler can bring one up (or one is starting, waking or asleep), waits at most this long for a
    # worker to take it; then it is withdrawn: 503 model_cold_start_timeout, free. request_timeout_s
    # bounds it too.
    cold_start_timeout_s: float = Field(default=600.0, gt=0)
    # Something outside Flatfare starts workers for queued requests (KEDA scaling pools from zero, see
    # deploy/k8s): every enabled catalog model is admitted without a warm worker, as if a fleet served it.
    external_scaler: bool = False
    # After Redis lost its data (the quota counters' generation changed), a request that hears
    # nothing from any worker for this long lost its job with the data: 503 job_lost, free. Workers
    # still running such a job say so once their lease renewal (every third of job_lease_s) finds its
    # entry gone, then every contract.timing.HELD_EVERY_S: this must exceed that (checked below).
    lost_job_after_s: float = 15.0
    # A gateway process silent this long died: another one settles the quota units it held
    # (billing/held.py). Processes renew every contract.timing.GATEWAY_BEAT_S (checked below).
    gateway_dead_after_s: float = 30.0
    # How long an authenticated key, the catalog and the live-worker view are reused in-process.
    auth_cache_ttl_s: float = 0.5
    pools_cache_ttl_s: float = 0.5
    plans_cache_ttl_s: float = 0.5
    # Backpressure per lane: most jobs waiting, and longest estimated wait (at the lane's recent
    # drain rate); past either, new requests get 429 with Retry-After at once.
    max_queue_depth_premium: int = 2000
    max_queue_depth_standard: int = 5000
    max_queue_wait_s_premium: float = 30.0
    max_queue_wait_s_standard: float = 120.0
    # Send requests sharing a long prompt prefix to the worker that served it last (prefix cache).
    prefix_routing: bool = True
    db_pool_size: int = 20
    # What each plan is sold, as the live figures are measured against it: the p99 time to first token
    # (whole answer when not streamed) and queue wait a plan's requests should stay under, in seconds.
    # Exported as flatfare_plan_ttft_target_seconds / flatfare_plan_queue_wait_target_seconds, drawn on
    # the Grafana dashboard and the admin console's, and alerted on (deploy/prometheus/rules). A plan
    # not named has no target.
    plan_ttft_target_s: dict[str, PositiveFloat] = Field(default_factory=lambda: {
        "premium": 5.0, "enterprise": 5.0, "pro": 15.0, "trial": 60.0, "free": 60.0})
    plan_queue_wait_target_s: dict[str, PositiveFloat] = Field(default_factory=lambda: {
        "premium": 2.0, "enterprise": 2.0, "pro": 10.0, "trial": 30.0, "free": 30.0})
    # How often each gateway process reads, for /metrics, each plan's quota used and the ledger's checks
    # (billing/checks.py: each reads the last day's ledger rows); scrapes in between reuse the last
    # reading. 0: at every scrape.
    metrics_ledger_every_s: float = Field(default=30.0, ge=0)
    # Where the gateway processes keep their metric files (prometheus_client's multiprocess mode);
    # emptied at start. Empty: a fresh temporary folder each start.
    metrics_dir: str = ""

    # Stripe. Billing endpoints answer 503 until a key and a webhook secret are set.
    stripe_api_key: SecretStr = SecretStr("")
    stripe_webhook_secret: SecretStr = SecretStr("")
    # Another Stripe-compatible server (localstripe in tests); empty means Stripe itself.
    stripe_api_base: str = ""
    # Flatfare plan -> Stripe Price id, e.g. {"pro": "price_123", "premium": "price_456"}.
    stripe_prices: dict[str, str] = Field(default_factory=dict)
    # Flatfare plan -> Stripe metered Price id (usage of the meter below), for plans with a per-request
    # price: Checkout attaches it beside the monthly price, so Stripe invoices the requests.
    stripe_metered_prices: dict[str, str] = Field(default_factory=dict)
    stripe_meter_event_name: str = "flatfare_requests"
    # Plan name -> the Stripe Price of the batch meter (Batch API lines), priced at the plan's per-request
    # price less its batch discount; Checkout attaches it beside the plan's metered price.
    stripe_batch_metered_prices: dict[str, str] = Field(default_factory=dict)
    stripe_batch_meter_event_name: str = "flatfare_batch_requests"
    # Seconds a Stripe call may take before it counts as failed (and is retried, for meter events).
    stripe_timeout_s: float = 20.0
    # Where Checkout and the customer portal send the developer back to.
    public_url: str = "http://127.0.0.1:8000"
    # Seconds between passes of the meter-event outbox (run by one gateway process at a time).
    billing_outbox_interval_s: float = 1.0
    # Longest wait between two tries of a meter event Stripe refused (the wait doubles from 1 s).
    billing_outbox_max_backoff_s: float = 3600.0
    # Meter-event calls in flight at once: the outbox sends about this many per Stripe round trip (at ~0.15 s a
    # call, 8 is ~50 events a second; Stripe accepts up to 1,000 meter-event calls a second in live mode).
    billing_outbox_concurrency: int = Field(default=8, ge=1, le=256)

    # The web console (gateway/console/), served at /console.
    # Local mode: the console is served over plain http on this machine (`flatfare up`, tests), so its
    # session cookie goes without Secure. Leave it off wherever users reach the gateway over https.
    local_mode: bool = False
    console_enabled: bool = True
    # Self sign-up; off makes the console invite-only (an admin creates the users).
    console_signup: bool = True
    # A new user must open an emailed link before logging in.
    console_require_email_verification: bool = False
    console_min_password_length: int = Field(default=10, ge=8, le=128)
    # A console session ends after this long without a request.
    console_session_idle_s: int = Field(default=8 * 3600, ge=60)
    # Failed logins allowed per account and per client address in each window, before 429.
    console_login_attempts: int = Field(default=10, ge=1)
    console_login_window_s: int = Field(default=900, ge=1)
    # A rotated key keeps working this long after its replacement is made.
    console_rotation_grace_s: int = Field(default=24 * 3600, ge=0)
    # The chat model the console names first (Quick start's snippets, the Playground's picker) when the
    # account's plan has it; the plan's other chat models follow by name (embedding models never appear).
    console_default_model: str = "smollm2-135m-instruct"
    # Where "Contact sales" on the console's plans page leads: an email address, shown as a mailto
    # link (FLATFARE_SALES_CONTACT); empty: the page offers no contact.
    sales_contact: str = Field(default="", max_length=254, pattern=r"^([^@\s<>\"]+@[^@\s<>\"]+)?$")
    # How long an emailed password-reset or verification link stays valid.
    console_link_ttl_s: int = Field(default=3600, ge=60)
    # Teams (gateway/console/team.py): members an account may have (pending invitations count), the
    # invitations it may send a day, and how long an invitation's link works.
    console_team_max_members: int = Field(default=25, ge=1, le=1000)
    console_team_invites_per_day: int = Field(default=20, ge=1, le=1000)
    console_team_invite_ttl_s: int = Field(default=7 * 86_400, ge=300)
    # The outgoing mail server for reset and verification links; with no host set, each link is
    # written to the gateway's log instead (marked "CONSOLE EMAIL"), which `flatfare up` shows.
    smtp_host: str = ""
    smtp_port: int = 587
    smtp_user: str = ""
    smtp_password: SecretStr = SecretStr("")
    smtp_from: str = "flatfare@localhost"
    smtp_starttls: bool = True

    # Shared-key detection (gateway/shared_keys.py): each API key's distinct client addresses and user
    # agents a UTC day, counted as keyed hashes (HMAC-SHA256) in Redis HyperLogLogs and kept this many
    # days; never the addresses themselves.
    shared_keys_keep_days: int = Field(default=7, ge=1, le=90)
    # The hashes' key. Empty: a random one, made once and kept in Redis beside the counts. Set it (the
    # same in every gateway process) so that a copy of Redis alone cannot test guessed addresses.
    shared_keys_secret: SecretStr = SecretStr("")
    # "At once" for a plan's shared_key_max_addresses: the distinct addresses a key was used from in
    # this many last seconds.
    shared_keys_window_s: int = Field(default=600, ge=10, le=86_400)
    # How often each gateway process looks for keys newly past their plan's alert threshold and emails
    # their owners (once per key and day, whichever process sees it first).
    shared_keys_check_every_s: float = Field(default=30.0, gt=0)

    # Quota alerts (gateway/quota_alerts.py): one gateway process at a time reads the day's quota counters
    # this often and sends an account's alerts (email, signed webhook) for the thresholds crossed.
    quota_alerts_every_s: float = Field(default=30.0, gt=0)
    # A delivery that failed is tried again after 1, 2, 4, ... seconds (at most this long), and given up
    # after this many tries (the console's delivery log shows each).
    quota_alerts_max_backoff_s: float = Field(default=3600.0, gt=0)
    quota_alerts_max_attempts: int = Field(default=8, ge=1, le=100)
    # Webhook URLs must be https and reach a public address. For tests and private deployments only:
    # allow http, and hosts (names or addresses, exactly as written in the URL) exempt from the
    # public-address check.
    quota_alerts_webhook_allow_http: bool = False
    quota_alerts_webhook_allow_hosts: list[str] = Field(default_factory=list, max_length=50)

    # The Files API (gateway/files/). Where the files' bytes live: "local", a folder (files_dir, default
    # files/ in the data folder; every gateway process must see the same one), or "s3", a bucket of
    # any S3-compatible store (AWS, MinIO, R2, ...). S3 credentials come from the fields below when
    # set, else from boto3's usual chain (AWS_* variables, ~/.aws, an instance role).
    files_backend: Literal["local", "s3"] = "local"
    files_dir: Path | None = None
    files_s3_bucket: str = ""
    files_s3_prefix: str = ""
    files_s3_endpoint_url: str = ""
    files_s3_region: str = ""
    files_s3_access_key_id: str = ""
    files_s3_secret_access_key: SecretStr = SecretStr("")
    # The largest file one upload may carry (OpenAI allows batch input up to 200 MB; this is what one
    # host holds comfortably), and what each account may keep at once. Uploads cost no quota unit.
    files_max_bytes: int = Field(default=100 * 1024 * 1024, ge=1)
    files_account_max_bytes: int = Field(default=1024 * 1024 * 1024, ge=1)
    files_account_max_files: int = Field(default=1000, ge=1)
    # How often each gateway process deletes expired files (their rows, bytes and counts).
    files_sweep_interval_s: float = Field(default=60.0, gt=0)
    # Stored responses (POST /v1/responses with store) are kept this long, as OpenAI keeps them; older
    # ones read as absent and each gateway process deletes them every files_sweep_interval_s.
    responses_retention_days: float = Field(default=30.0, gt=0)

    @model_validator(mode="after")
    def _times_fit_the_workers(self) -> GatewaySettings:
        """The cross-process timing rules a gateway's settings must keep (flatfare.contract.timing)."""
        try:
            timing.check_lost_job_after(self.lost_job_after_s, self.job_lease_s)
            timing.check_dead_after(self.gateway_dead_after_s)
        except timing.TimingRuleBroken as exc:
            raise ValueError(str(exc)) from exc
        return self

    @property
    def stripe_enabled(self) -> bool:
        return bool(self.stripe_api_key.get_secret_value() and self.stripe_webhook_secret.get_secret_value())

    def stripe_config(self) -> StripeConfig:
        return StripeConfig(api_key=self.stripe_api_key.get_secret_value(),
                            webhook_secret=self.stripe_webhook_secret.get_secret_value(),
                            api_base=self.stripe_api_base or None, meter_event_name=self.stripe_meter_event_name,
                            batch_meter_event_name=self.stripe_batch_meter_event_name, timeout_s=self.stripe_timeout_s)
