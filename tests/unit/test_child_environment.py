"""What a supervised child is given of the supervisor's settings (``children.child``):
the ``DARKROOM_*`` variables of the kernel's section and of its own service's, none
of the other sections' (a sampler holds no API key, no HTTP setting, not the path of
the gateway's TLS key), and the rest of the supervisor's environment as it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config.http import HttpSettings
from services.config.sections import GatewaySettings, KernelSettings, SchedulerSettings, Settings
from services.config.workers import DecoderSettings, SamplerSettings
from services.ops.children import child, host_children
from tests.helpers import env_of

# The variables of one section that no other section reads.
GATEWAY_ONLY = GatewaySettings.variables() - HttpSettings.variables() - SchedulerSettings.variables()
SAMPLER_ONLY = SamplerSettings.variables() - DecoderSettings.variables()
HTTP_ONLY = HttpSettings.variables() - GatewaySettings.variables()
SCHEDULER_ONLY = SchedulerSettings.variables() - GatewaySettings.variables()


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    # The supervisor's own environment: its settings, a client's key, and what is no setting.
    monkeypatch.setenv("DARKROOM_API_KEYS", "admin-key-of-the-environment")
    monkeypatch.setenv("DARKROOM_API_KEY", "a-clients-key")
    monkeypatch.setenv("SOME_TOOL_HOME", "/opt/tool")
    return Settings.from_env(
        env_of(
            data_dir=tmp_path,
            database_url="postgresql+psycopg://darkroom:pw@db:5432/darkroom",
            api_keys=("admin-key",),
            gateway_host="0.0.0.0",
            gateway_tls_cert=str(tmp_path / "gateway.pem"),
            gateway_tls_key=str(tmp_path / "gateway.key"),
            http_host="10.0.0.5",
            http_url_key_file=str(tmp_path / "http-url.key"),
            capabilities=("image",),
            scheduler_batch=32,
            decode_max_batch=4,
        )
    )


def settings_given(service: str, settings: Settings) -> set[str]:
    return {k for k in child(settings, service, service).env if k.startswith("DARKROOM_")}


def test_a_sampler_and_a_decoder_hold_nothing_of_the_gateways_the_http_apis_or_the_schedulers(
    settings: Settings,
) -> None:
    for service in ("sampler", "decoder"):
        env = child(settings, f"{service}-0", service).env
        assert "DARKROOM_API_KEYS" not in env and "DARKROOM_API_KEY" not in env
        assert "DARKROOM_GATEWAY_TLS_KEY" not in env and not GATEWAY_ONLY & env.keys()
        assert not [k for k in env if k.startswith("DARKROOM_HTTP_")] and not HTTP_ONLY & env.keys()
        assert not SCHEDULER_ONLY & env.keys()
        # The kernel's (the database) and what is no setting pass.
        assert env["DARKROOM_DATABASE_URL"] == settings.kernel.database_url
        assert env["SOME_TOOL_HOME"] == "/opt/tool" and "PATH" in env
    sampler, decoder = settings_given("sampler", settings), settings_given("decoder", settings)
    assert "DARKROOM_CAPABILITIES" in sampler and "DARKROOM_CAPABILITIES" not in decoder
    assert "DARKROOM_DECODE_MAX_BATCH" in decoder and not SAMPLER_ONLY & decoder
    assert sampler <= KernelSettings.variables() | SamplerSettings.variables()
    assert decoder <= KernelSettings.variables() | DecoderSettings.variables()


def test_the_gateway_holds_its_own_and_of_the_http_apis_only_its_listener(settings: Settings) -> None:
    env = child(settings, "gateway", "gateway").env
    assert env["DARKROOM_API_KEYS"] == "admin-key" and env["DARKROOM_GATEWAY_TLS_KEY"] == str(
        settings.kernel.data_dir / "gateway.key"
    )
    # Its open-access check counts the HTTP API's listener (services/open_access.py).
    assert env["DARKROOM_HTTP_HOST"] == "10.0.0.5"
    assert "DARKROOM_HTTP_URL_KEY_FILE" not in env and "DARKROOM_API_KEY" not in env
    assert not SAMPLER_ONLY & env.keys() and "DARKROOM_DECODE_MAX_BATCH" not in env
    assert not SCHEDULER_ONLY & env.keys()


def test_the_http_api_and_the_scheduler_hold_their_own(settings: Settings) -> None:
    http = child(settings, "http", "http").env
    assert http["DARKROOM_HTTP_URL_KEY_FILE"] == str(settings.kernel.data_dir / "http-url.key")
    assert "DARKROOM_API_KEYS" not in http and "DARKROOM_GATEWAY_TLS_KEY" not in http
    assert not SAMPLER_ONLY & http.keys() and not SCHEDULER_ONLY & http.keys()
    scheduler = child(settings, "scheduler", "scheduler").env
    assert scheduler["DARKROOM_SCHEDULER_BATCH"] == "32"
    assert "DARKROOM_API_KEYS" not in scheduler and not [k for k in scheduler if k.startswith("DARKROOM_HTTP_")]
    assert not SAMPLER_ONLY & scheduler.keys() and "DARKROOM_GATEWAY_TLS_KEY" not in scheduler


def test_a_hosts_children_keep_their_own_changes(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """``darkroom supervise``'s children: what the host sets for each (device, id, port) is still given."""
    monkeypatch.setattr("services.ops.children.visible_gpus", lambda: 0)
    children = host_children(settings, decoders=1, cpu_samplers=1)
    sampler = next(c for c in children if c.service == "sampler")
    decoder = next(c for c in children if c.service == "decoder")
    assert sampler.env["DARKROOM_DEVICE"] == "cpu" and sampler.env["DARKROOM_WORKER_ID"].endswith("-cpu0")
    assert decoder.env["DARKROOM_WORKER_ID"].endswith("-decoder0") and "DARKROOM_METRICS_PORT" in decoder.env
    assert all("DARKROOM_API_KEYS" not in c.env for c in children)
