from __future__ import annotations

from pathlib import Path

import pytest
from google.rpc import code_pb2, error_details_pb2

from services.config.settings import Settings, SettingsError
from services.errors import FieldViolation, InvalidArgument, NotFound, ResourceExhausted, StoreUnavailable
from services.rpc.status import to_status


def test_settings_from_env_parse_each_type() -> None:
    s = Settings.from_env(
        {
            "DARKROOM_GATEWAY_PORT": "7000",
            "DARKROOM_HEARTBEAT_INTERVAL_S": "0.5",
            "DARKROOM_API_KEYS": "a, b",
            "DARKROOM_DATA_DIR": "/tmp/x",
            "OTHER": "1",
        }
    )
    assert s.gateway_port == 7000 and s.heartbeat_interval_s == 0.5
    assert s.api_keys == ("a", "b") and s.data_dir == Path("/tmp/x")


def test_settings_round_trip_through_env() -> None:
    s = Settings(gateway_port=1234, api_keys=("k",), preload_models=("tiny",), local_decode_fallback=True)
    assert Settings.from_env(s.to_env()) == s


def test_bad_setting_names_the_variable() -> None:
    with pytest.raises(SettingsError, match="DARKROOM_GATEWAY_PORT"):
        Settings.from_env({"DARKROOM_GATEWAY_PORT": "many"})


@pytest.mark.parametrize(
    ("variable", "value"),
    [("DARKROOM_MAX_ATTEMPTS", "0"), ("DARKROOM_WORKER_STALE_AFTER_S", "-1"), ("DARKROOM_HANG_AFTER_S", "nan")],
)
def test_out_of_range_setting_names_the_variable(variable: str, value: str) -> None:
    with pytest.raises(SettingsError, match=variable):
        Settings.from_env({variable: value})


def test_booleans_and_server_lists() -> None:
    s = Settings.from_env(
        {"DARKROOM_LOCAL_DECODE_FALLBACK": "yes", "DARKROOM_NATS_URL": "nats://a:1, nats://b:2,nats://c:3"}
    )
    assert s.local_decode_fallback is True
    assert s.nats_servers == ["nats://a:1", "nats://b:2", "nats://c:3"]
    assert Settings.from_env({"DARKROOM_LOCAL_DECODE_FALLBACK": "off"}).local_decode_fallback is False
    with pytest.raises(SettingsError, match="DARKROOM_LOCAL_DECODE_FALLBACK"):
        Settings.from_env({"DARKROOM_LOCAL_DECODE_FALLBACK": "maybe"})


def test_invalid_argument_carries_field_violations() -> None:
    status = to_status(InvalidArgument([FieldViolation("width", "too big")]))
    assert status.code == code_pb2.INVALID_ARGUMENT
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "width"


def test_resource_exhausted_carries_retry_delay() -> None:
    status = to_status(ResourceExhausted("busy", retry_after_s=2.5))
    info = error_details_pb2.RetryInfo()
    assert status.code == code_pb2.RESOURCE_EXHAUSTED and status.details[0].Unpack(info)
    assert info.retry_delay.seconds == 2 and info.retry_delay.nanos == 500_000_000


def test_other_errors_map_to_their_codes() -> None:
    assert to_status(NotFound("x")).code == code_pb2.NOT_FOUND
    assert to_status(StoreUnavailable("x")).code == code_pb2.UNAVAILABLE
    assert to_status(RuntimeError("secret")).message == "internal error"
