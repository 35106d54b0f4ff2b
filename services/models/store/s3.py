"""The S3 client under the model store's ``ObjectStore``: made from the settings
(or scoped to a folder of the same bucket), and the one place the driver's errors
become the project's: a refusal (these credentials may not) is ``ModelStoreError``,
anything else the store being away (``ModelStoreUnavailable``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from obstore.exceptions import BaseError, PermissionDeniedError, UnauthenticatedError
from obstore.store import S3Store

from services.config.model_store import ModelStoreSettings
from services.models.store.errors import ModelStoreError, ModelStoreUnavailable

if TYPE_CHECKING:
    from obstore.store import ClientConfig

_FORBIDDEN = "non-2xx status code: 403 Forbidden"
# A store that does not answer fails a command in seconds, not after the
# driver's default three minutes of retries.
_RETRY = {"max_retries": 3, "retry_timeout": timedelta(seconds=20)}


def s3_client(settings: ModelStoreSettings) -> S3Store:
    if not settings.model_store_url:
        raise ModelStoreError("no model store is configured: set DARKROOM_MODEL_STORE_URL (and its credentials)")
    options: ClientConfig = {"allow_http": True, "connect_timeout": timedelta(seconds=5)}
    credentials: dict[str, Any] = {}
    if settings.model_store_access_key:
        credentials = {
            "access_key_id": settings.model_store_access_key,
            "secret_access_key": settings.model_store_secret_key,
        }
    else:
        credentials = {"skip_signature": True}
    return S3Store(
        settings.model_store_bucket,
        endpoint=settings.model_store_url,
        region=settings.model_store_region,
        client_options=options,
        retry_config=_RETRY,  # type: ignore[arg-type]
        virtual_hosted_style_request=False,
        **credentials,
    )


def scoped_client(store: S3Store, prefix: str) -> S3Store:
    """``store``'s client, its identity and options, every key under ``prefix``."""
    return S3Store(
        config=store.config,
        client_options=store.client_options,
        retry_config=store.retry_config,
        prefix=f"{store.prefix or ''}/{prefix}".strip("/"),
    )


@contextmanager
def driver_errors(url: str, bucket: str, doing: str) -> Iterator[None]:
    """The driver's errors while ``doing``, as the project's."""
    try:
        yield
    except (BaseError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        # The driver tells a refused listing only by its status (a generic error).
        if isinstance(exc, PermissionDeniedError | UnauthenticatedError) or _FORBIDDEN in str(exc):
            raise ModelStoreError(
                f"model store {url} (bucket {bucket}): {doing}: refused ({first}); pushing, listing "
                "and removing need the writer's identity (DARKROOM_MODEL_STORE_WRITER_ACCESS_KEY and _SECRET_KEY)"
            ) from exc
        raise ModelStoreUnavailable(f"model store {url} (bucket {bucket}): {doing}: {first}") from exc
